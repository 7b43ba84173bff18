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
    # Other questions about the same document and their answers (the end-to-end benchmark asks
    # a context several ways): the other keys, the other people, rephrasings.
    more_questions: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def questions(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        return ((self.question, self.answers), *self.more_questions)

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


def split_prompt(
    tokenizer: Any, case: Case, chunk_tokens: int = CHUNK_TOKENS, question: str = "",
    system: str = "",
) -> PromptSplit:  # fmt: skip
    """The chat prompt's ids (the case's question, or ``question``; after a system message
    ``system`` when given, else the template's default) and the context length (through the
    document, whole chunks)."""

    def chat(content: str) -> list[int]:
        messages = [{"role": "user", "content": content}]
        if system:
            messages.insert(0, {"role": "system", "content": system})
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    full = chat(f"{case.document}\n\n{question or case.question}")
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
    facts, question, answers, more = _BUILDERS[task](rnd)
    people = [_biography(rnd) for _ in range(FACT_DISTRACTORS)] if task == "fact_qa" else []
    distractors = [sentence for sentence, _, _ in people]
    more += [(_city_question(name), [city]) for _, name, city in people]
    planted = " ".join(facts + distractors)
    budget = length - _tokens(tokenizer, planted) - 60  # chat template + question
    filler = _filler(tokenizer, rnd, budget)
    for sentence in distractors:
        filler.insert(rnd.randint(0, len(filler)), sentence)
    document = " ".join(_plant(filler, facts, depth, rnd))
    extra = tuple((q, tuple(a)) for q, a in more)
    return Case(task, length, seed, document, question, tuple(answers), depth, extra)


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


Built = tuple[list[str], str, list[str], list[tuple[str, list[str]]]]
"""A task's facts, its question and answers, and other questions with their answers."""


def _number_question(key: str) -> str:
    return f"What is the special magic number for {key}? Answer with the number only."


def _single(rnd: random.Random) -> Built:
    key, value = rnd.choice(_KEYS), _number(rnd)
    again = f"Which number does the text give as the special magic number for {key}?"
    fact = f"The special magic number for {key} is {value}."
    return [fact], _number_question(key), [value], [(again, [value])]


def _multikey(rnd: random.Random) -> Built:
    keys = rnd.sample(_KEYS, 3)
    values = [_number(rnd) for _ in keys]
    facts = [f"The special magic number for {k} is {v}." for k, v in zip(keys, values, strict=True)]
    ask = rnd.randrange(3)
    order = list(range(3))
    rnd.shuffle(order)
    more = [(_number_question(keys[i]), [values[i]]) for i in range(3) if i != ask]
    return [facts[i] for i in order], _number_question(keys[ask]), [values[ask]], more


def _multivalue(rnd: random.Random) -> Built:
    key = rnd.choice(_KEYS)
    values = [_number(rnd) for _ in range(2)]
    facts = [f"One of the special magic numbers for {key} is {v}." for v in values]
    question = f"What are all the special magic numbers for {key}? List the numbers only."
    again = f"List every special magic number the text gives for {key}."
    return facts, question, values, [(again, values)]


def _variables(rnd: random.Random) -> Built:
    names = ["".join(rnd.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(5)) for _ in range(2)]
    value = _number(rnd)
    facts = [f"VAR {names[0]} = {value}."]
    facts += [f"VAR {b} = VAR {a}." for a, b in itertools.pairwise(names)]
    question = (
        f"Which variables are assigned the value {value}, directly or through other variables? "
        "List the variable names only."
    )
    again = f"Name the variables whose value is {value}."
    return facts, question, names, [(again, names)]


def _biography(rnd: random.Random) -> tuple[str, str, str]:
    name = f"{rnd.choice(_FIRST)} {rnd.choice(_LAST)}"
    city = rnd.choice(_CITIES)
    sentence = f"{name} is a {rnd.choice(_JOBS)} who lives in {city}."
    return sentence, name, city


def _city_question(name: str) -> str:
    return f"Which city does {name} live in? Answer with the city only."


def _fact_qa(rnd: random.Random) -> Built:
    # a name no filler biography uses: first and last names drawn outside the filler's lists
    name = f"{rnd.choice(['Tamsin', 'Ulrich', 'Wanda', 'Xavier', 'Yusuf', 'Zelda'])} "
    name += rnd.choice(["Quill", "Rook", "Sable", "Thorne", "Vance", "Wren"])
    city = rnd.choice(_CITIES)
    fact = f"{name} is a journalist who lives in {city}."
    return [fact], _city_question(name), [city], []


_BUILDERS: dict[str, Callable[[random.Random], Built]] = {
    "niah_single": _single,
    "niah_multikey": _multikey,
    "niah_multivalue": _multivalue,
    "variable_tracking": _variables,
    "fact_qa": _fact_qa,
}
