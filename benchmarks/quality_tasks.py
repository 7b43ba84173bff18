"""RULER-style long-context tasks, generated here (Hsieh et al. 2024, "RULER: What's the Real
Context Size of Your Long-Context Language Models?"; the task kinds, not their code or data).

Every case is a document of about ``length`` tokens of varied filler sentences with facts planted
at chosen depths, and one question whose answer is those facts. The prompt is the model's chat
template with the document and the question in one user turn; the *context* — what kvtierd
caches and compresses — is the prompt from its first token through the end of the document,
rounded down to whole LMCache chunks, and the rest (document tail, question, template) is the
query. Cases are deterministic in their seed.

Kinds:
* ``niah_single``: one needle ("The special magic number for K is V.") at a depth.
* ``niah_multikey``: three needles with different keys; the question asks for one of them.
* ``niah_multivalue``: two values under one key; the answer must name both.
* ``variable_tracking``: ``VAR A = 12345.`` then ``VAR B = VAR A.`` later in the document; the
  answer must name both variables.
* ``fact_qa``: synthetic biographies (person, city, year, job) among the filler, one question
  about one person; the other biographies are distractors.

The sizes (three keys, two values, one hop, two other biographies) are what SmolLM2-135M answers
with its full KV at 1-4k tokens often enough for a drop to show; RULER's own sizes (four keys,
four values, four hops) are beyond a model of this size even uncompressed.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking", "fact_qa")
CHUNK_TOKENS = 16  # LMCache's chunk_size in the serving stack (docs/integration.md)
FACT_DISTRACTORS = 2  # SmolLM2-135M answers 0.6 of 5 with none, 0.4 with 2, 0.2 with 5 (1k tokens)

_SUBJECTS = ["The committee", "An old farmer", "The museum", "Our neighbour", "The orchestra",
             "A young engineer", "The city council", "The ferry captain", "The bakery",
             "A retired teacher", "The research team", "The librarian"]  # fmt: skip
_VERBS = ["reviewed", "repaired", "painted", "described", "measured", "ordered", "sold",
          "photographed", "planned", "discussed", "delivered", "catalogued"]  # fmt: skip
_OBJECTS = ["the quarterly budget", "a wooden bridge", "the harbour walls", "a set of old maps",
            "the spring barley", "a pair of brass clocks", "the new train timetable",
            "a box of letters", "the garden fence", "the winter festival", "a row of lamps",
            "the village records"]  # fmt: skip
_TAILS = ["before the rain began.", "after a long and quiet morning.", "near the river bank.",
          "without telling anyone.", "for the third time that year.", "under a grey sky.",
          "with great care.", "as the bells rang at noon.", "on the edge of town.",
          "while the children watched."]  # fmt: skip
_KEYS = ["Orion", "Maple", "Cobalt", "Juniper", "Falcon", "Sierra", "Willow", "Ember", "Quartz",
         "Harbor", "Lantern", "Meadow", "Summit", "Violet", "Anchor", "Cedar"]  # fmt: skip
_FIRST = ["Alice", "Bruno", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ines",
          "Jonas", "Keiko", "Lars", "Mira", "Nikos", "Olga", "Pavel", "Rosa", "Sven"]  # fmt: skip
_LAST = ["Alder", "Brook", "Crane", "Dale", "Ember", "Frost", "Grove", "Hale", "Irving",
         "Joyce", "Keller", "Lowe", "Marsh", "North", "Oakes", "Pryce"]  # fmt: skip
_CITIES = ["Lisbon", "Oslo", "Krakow", "Porto", "Ghent", "Tartu", "Bergen", "Turin", "Lyon",
           "Graz", "Split", "Cork", "Malmo", "Leipzig", "Bilbao", "Aarhus"]  # fmt: skip
_JOBS = ["architect", "baker", "chemist", "diver", "editor", "farmer", "geologist", "harpist",
         "jeweller", "librarian", "mechanic", "nurse", "optician", "pilot"]  # fmt: skip


@dataclass(frozen=True, slots=True)
class Case:
    """One document + question. ``answers``: strings the reply must contain (all of them)."""

    task: str
    length: int
    seed: int
    document: str
    question: str
    answers: tuple[str, ...]
    depth: float

    @property
    def name(self) -> str:
        return f"{self.task}/{self.length}/{self.seed}"


@dataclass(frozen=True, slots=True)
class PromptSplit:
    """A case as token ids: ``ids[:context_tokens]`` is the context, the rest the query."""

    ids: tuple[int, ...]
    context_tokens: int

    @property
    def context(self) -> list[int]:
        return list(self.ids[: self.context_tokens])

    @property
    def query(self) -> list[int]:
        return list(self.ids[self.context_tokens :])


def accuracy(case: Case, answer: str) -> float:
    """Share of the expected strings found in ``answer`` (case-insensitive), as RULER scores."""
    text = answer.lower()
    return sum(a.lower() in text for a in case.answers) / len(case.answers)


def split_prompt(tokenizer: Any, case: Case, chunk_tokens: int = CHUNK_TOKENS) -> PromptSplit:
    """The chat prompt's ids and the context length (through the document, whole chunks)."""

    def chat(content: str) -> list[int]:
        out = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True
        )
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    full = chat(f"{case.document}\n\n{case.question}")
    doc_only = chat(case.document)
    common = 0
    while common < min(len(full), len(doc_only)) and full[common] == doc_only[common]:
        common += 1
    return PromptSplit(ids=tuple(full), context_tokens=common // chunk_tokens * chunk_tokens)


def make_case(tokenizer: Any, task: str, length: int, seed: int) -> Case:
    """A case of ``task`` whose document is about ``length`` tokens."""
    if task not in _BUILDERS:
        raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    rnd = random.Random(f"{task}/{length}/{seed}")
    depth = (seed % 5 + 0.5) / 5  # 0.1, 0.3, 0.5, 0.7, 0.9
    facts, question, answers = _BUILDERS[task](rnd)
    distractors = [_biography(rnd)[0] for _ in range(FACT_DISTRACTORS)] if task == "fact_qa" else []
    planted = " ".join(facts + distractors)
    budget = length - _tokens(tokenizer, planted) - 60  # chat template + question
    filler = _filler(tokenizer, rnd, budget)
    for sentence in distractors:
        filler.insert(rnd.randint(0, len(filler)), sentence)
    document = " ".join(_plant(filler, facts, depth, rnd))
    return Case(task, length, seed, document, question, tuple(answers), depth)


def make_cases(tokenizer: Any, tasks: list[str], lengths: list[int], per: int) -> list[Case]:
    return [make_case(tokenizer, t, n, s) for n in lengths for t in tasks for s in range(per)]


def _tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _filler(tokenizer: Any, rnd: random.Random, budget: int) -> list[str]:
    sentences: list[str] = []
    used = 0
    while used < budget:
        s = _sentence(rnd)
        sentences.append(s)
        used += _tokens(tokenizer, s) + 1
    return sentences


def _plant(filler: list[str], facts: list[str], depth: float, rnd: random.Random) -> list[str]:
    """The first fact at ``depth``; the others spread after it (variable chains keep order)."""
    out = list(filler)
    n = len(out)
    first = int(n * depth)
    spots = [first, *sorted(rnd.randint(first, n) for _ in facts[1:])]
    for offset, (spot, fact) in enumerate(zip(spots, facts, strict=True)):
        out.insert(min(spot + offset, len(out)), fact)
    return out


def _sentence(rnd: random.Random) -> str:
    return " ".join(rnd.choice(x) for x in (_SUBJECTS, _VERBS, _OBJECTS, _TAILS))


def _number(rnd: random.Random) -> str:
    return str(rnd.randint(10000, 99999))


def _single(rnd: random.Random) -> tuple[list[str], str, list[str]]:
    key, value = rnd.choice(_KEYS), _number(rnd)
    question = f"What is the special magic number for {key}? Answer with the number only."
    return [f"The special magic number for {key} is {value}."], question, [value]


def _multikey(rnd: random.Random) -> tuple[list[str], str, list[str]]:
    keys = rnd.sample(_KEYS, 3)
    values = [_number(rnd) for _ in keys]
    facts = [f"The special magic number for {k} is {v}." for k, v in zip(keys, values, strict=True)]
    ask = rnd.randrange(3)
    question = f"What is the special magic number for {keys[ask]}? Answer with the number only."
    order = list(range(3))
    rnd.shuffle(order)
    return [facts[i] for i in order], question, [values[ask]]


def _multivalue(rnd: random.Random) -> tuple[list[str], str, list[str]]:
    key = rnd.choice(_KEYS)
    values = [_number(rnd) for _ in range(2)]
    facts = [f"One of the special magic numbers for {key} is {v}." for v in values]
    question = f"What are all the special magic numbers for {key}? List the numbers only."
    return facts, question, values


def _variables(rnd: random.Random) -> tuple[list[str], str, list[str]]:
    names = ["".join(rnd.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(5)) for _ in range(2)]
    value = _number(rnd)
    facts = [f"VAR {names[0]} = {value}."]
    facts += [f"VAR {b} = VAR {a}." for a, b in itertools.pairwise(names)]
    question = (
        f"Which variables are assigned the value {value}, directly or through other variables? "
        "List the variable names only."
    )
    return facts, question, names


def _biography(rnd: random.Random) -> tuple[str, str, str]:
    name = f"{rnd.choice(_FIRST)} {rnd.choice(_LAST)}"
    city = rnd.choice(_CITIES)
    sentence = f"{name} is a {rnd.choice(_JOBS)} who lives in {city}."
    return sentence, name, city


def _fact_qa(rnd: random.Random) -> tuple[list[str], str, list[str]]:
    # a name no filler biography uses: first and last names drawn outside the filler's lists
    name = f"{rnd.choice(['Tamsin', 'Ulrich', 'Wanda', 'Xavier', 'Yusuf', 'Zelda'])} "
    name += rnd.choice(["Quill", "Rook", "Sable", "Thorne", "Vance", "Wren"])
    city = rnd.choice(_CITIES)
    fact = f"{name} is a journalist who lives in {city}."
    question = f"Which city does {name} live in? Answer with the city only."
    return [fact], question, [city]


_BUILDERS: dict[str, Callable[[random.Random], tuple[list[str], str, list[str]]]] = {
    "niah_single": _single,
    "niah_multikey": _multikey,
    "niah_multivalue": _multivalue,
    "variable_tracking": _variables,
    "fact_qa": _fact_qa,
}
