"""Contexts that differ in how much compression they tolerate, each with many short questions
(issue 39, item 1). Generated here, deterministic in ``(kind, length, seed)``.

A context is a document of about ``length`` tokens made of *facts* (a sentence or record that
answers one question) and *filler* (text no question asks about). The kinds differ in how
the facts sit in the document, which is what decides whether a token-dropping method keeps an
answer:

* ``narrative``: a story in which every fact is told three times, in three phrasings, among
  narrative sentences — redundant: losing one telling leaves two.
* ``logs``: service log lines; each service always runs on the same host and port, so every
  fact recurs in many lines — redundant, machine-like.
* ``table``: a dense table of records (name, city, code, year), one fact per cell, each once.
* ``code``: a Python module of constants and small functions; each constant is set once, among
  boilerplate code.
* ``chat``: a multi-turn conversation in which the user mentions facts about themselves once
  each, among small talk.
* ``mixture``: one-line records among filler sentences, with the filler's share of the document
  varied by the seed (0.2 to 0.9): dense to sparse.

Every question asks for one short value whose text is the expected answer, and comes with
the reply's first words (``lead``: "The code of Hiro Pryce is"), given to the model after the
chat template's assistant turn opens, so that a greedy answer is the value in a few tokens;
20 questions per context (fewer when the kind has fewer distinct facts at that length),
so that a context's share of questions kept is measured with enough questions to rank contexts
(issue 39 asks for a split-half reliability of 0.6). ``fact_share`` is the share of the
document's characters that are facts: the model-free reference the issue names (1 minus it
ranks contexts by how much of them no question needs).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

KINDS = ("narrative", "logs", "table", "code", "chat", "mixture")
QUESTIONS = 20

KEYS = ("apple", "river", "window", "garden", "bridge", "castle", "forest", "island", "market",
        "mountain", "pencil", "rocket", "silver", "tiger", "violin", "wagon", "anchor", "basket",
        "candle", "dragon", "engine", "falcon", "guitar", "hammer", "jacket", "kettle", "ladder",
        "mirror", "needle", "orange", "palace", "rabbit", "saddle", "tunnel", "vessel", "wallet",
        "barrel", "cactus", "donkey", "feather", "glove", "helmet", "lemon", "magnet", "nickel",
        "oyster", "parrot", "quilt", "ribbon", "spider", "tomato", "velvet", "walnut", "zebra",
        "bottle", "button", "camera", "carpet", "cherry", "cotton", "desert", "doctor", "eagle",
        "fabric", "finger", "flower", "garlic", "ginger", "hunter", "jungle", "kitten", "lizard",
        "marble", "meadow", "monkey", "ocean", "pepper", "pillow", "planet", "pocket", "puppet",
        "rubber", "salmon", "shadow", "shovel", "spoon", "statue", "summer", "sunset", "temple",
        "ticket", "turtle", "valley")  # fmt: skip
"""What facts are about: words of one token each for SmolLM2's tokenizer, one fact per word in
a context, so that a question names its fact by a token no other fact has (the 135M model
confuses facts whose keys share tokens, such as two-word names)."""
_STORY = ["The morning was quiet and the streets were still wet from the rain.",
          "Nobody in the village remembered a winter as long as that one.",
          "The market square filled slowly as the stalls opened one by one.",
          "A cold wind came down from the hills and rattled the shutters.",
          "Later that day the children ran along the river looking for stones.",
          "The old clock on the church tower struck the hour twice by mistake.",
          "Everyone agreed that the festival had been the best in years.",
          "The baker sold the last loaf just before noon, as he always did.",
          "Clouds gathered over the harbour and the fishermen came home early.",
          "In the evening the lamps were lit along the narrow lanes.",
          "The road to the next town was closed for repairs all spring.",
          "Somewhere a dog barked and then the night was silent again."]  # fmt: skip
_SMALL_TALK = ["How was your weekend?", "It rained the whole time, but we had fun anyway.",
               "That sounds lovely. Did you try the new cafe?", "Not yet, maybe next week.",
               "I have been so busy with work lately.", "Same here, it never stops.",
               "Do you have any plans for the holidays?", "Nothing fixed, we will see.",
               "The weather has been strange this year.", "Yes, far too warm for November.",
               "I finally finished that book you recommended.",
               "Did you like the ending?"]  # fmt: skip


@dataclass(frozen=True, slots=True)
class Fact:
    """One answerable fact: its sentence(s) in the document, a question and the answer text."""

    tellings: tuple[str, ...]  # each a sentence or line of the document
    question: str
    answer: str
    lead: str  # the reply's first words, given to the model so that it answers at once


@dataclass(frozen=True, slots=True)
class KindCase:
    """A generated context and its questions, ``(question, answer)``."""

    kind: str
    length: int
    seed: int
    document: str
    questions: tuple[tuple[str, str, str], ...]  # (question, lead, answer)
    fact_share: float

    @property
    def name(self) -> str:
        return f"{self.kind}/{self.length}/{self.seed}"


@dataclass(frozen=True, slots=True)
class Redundancy:
    """How a context of a kind is made (the knob that makes contexts of one kind differ):
    ``tellings``, how many times each fact is told (in that many phrasings, spread over the
    document); ``fact_share``, the share of the token budget facts take before filler fills the
    rest (at least :data:`MIN_FACTS` facts whatever the share, as many as fit)."""

    tellings: int
    fact_share: float

    def __post_init__(self) -> None:
        if not 1 <= self.tellings <= MAX_TELLINGS or not 0.0 < self.fact_share <= 1.0:
            raise ValueError(
                f"redundancy needs 1 <= tellings <= {MAX_TELLINGS} and 0 < fact_share <= 1, "
                f"got {self.tellings}, {self.fact_share}"
            )


MAX_TELLINGS = 4
MIN_FACTS = 16
ASKED_WITH_REDUNDANCY = len(KEYS)
"""With a :class:`Redundancy` every fact is asked about (a context's label needs many
questions to be measured well)."""


def draw_redundancy(kind: str, length: int, seed: int) -> Redundancy:
    """The redundancy of a labelled context, drawn from its ``(kind, length, seed)`` over a wide
    range: each fact told 1 to 4 times, facts 15% to 95% of the budget."""
    rnd = random.Random(f"redundancy/{kind}/{length}/{seed}")
    return Redundancy(rnd.randint(1, MAX_TELLINGS), round(rnd.uniform(0.15, 0.95), 3))


def make_kind_case(
    tokenizer: Any, kind: str, length: int, seed: int, redundancy: Redundancy | None = None
) -> KindCase:
    """A context of ``kind`` of about ``length`` tokens (the chat template and a question of
    ~40 tokens fit beside it). Without ``redundancy``: the kind's own (module docstring), and
    :data:`QUESTIONS` questions at most; with it: each fact told ``redundancy.tellings`` times,
    facts ``redundancy.fact_share`` of the budget, and every fact asked about."""
    if kind not in _BUILDERS:
        raise ValueError(f"unknown kind {kind!r}; known: {', '.join(KINDS)}")
    rnd = random.Random(f"{kind}/{length}/{seed}")
    budget = length - 60
    build, filler = _BUILDERS[kind]
    facts: list[Fact] = []
    lines: list[str] = []
    fact_chars = 0
    sep = "\n" if kind in ("logs", "table", "code", "chat") else " "
    # facts first up to their share of the budget, then filler to the length
    share = _FACT_SHARE[kind] if kind != "mixture" else 0.8 - 0.7 * (seed % 8) / 7
    if redundancy is not None:
        share = redundancy.fact_share
    for key in rnd.sample(KEYS, len(KEYS)):  # one fact per key: keys tell facts apart
        count = _count(tokenizer, lines, sep)
        if redundancy is None:
            if count >= budget * share:
                break
        elif count >= budget or (count >= budget * share and len(facts) >= MIN_FACTS):
            break
        fact = build(rnd, key)
        if redundancy is not None:
            fact = _retold(kind, fact, key, redundancy.tellings, rnd)
            if facts and _count(tokenizer, [*lines, *fact.tellings], sep) > budget:
                break
        facts.append(fact)
        lines.extend(fact.tellings)
        fact_chars += sum(len(t) + 1 for t in fact.tellings)
    rnd.shuffle(lines)
    while _count(tokenizer, lines, sep) < budget:
        lines.insert(rnd.randint(0, len(lines)), filler(rnd))
    while _count(tokenizer, lines, sep) > budget:  # the last addition overshot: drop filler
        spare = [i for i, x in enumerate(lines) if not _is_fact(x, facts)]
        if not spare:
            break
        del lines[spare[-1]]
    document = _header(kind) + sep.join(lines)
    most = QUESTIONS if redundancy is None else ASKED_WITH_REDUNDANCY
    asked = rnd.sample(facts, min(most, len(facts)))
    questions = tuple((f.question, f.lead, f.answer) for f in asked)
    return KindCase(kind, length, seed, document, questions, fact_chars / max(len(document), 1))


def _count(tokenizer: Any, lines: list[str], sep: str) -> int:
    return len(tokenizer(sep.join(lines), add_special_tokens=False)["input_ids"])


def _is_fact(line: str, facts: list[Fact]) -> bool:
    return any(line in f.tellings for f in facts)


def _header(kind: str) -> str:
    return {
        "narrative": "",
        "logs": "Service log excerpt:\n",
        "table": "Price list (item costs price | stock | shelf):\n",
        "code": "# settings.py\n",
        "chat": "Conversation between a user and an assistant:\n",
        "mixture": "",
    }[kind]


def _value(rnd: random.Random) -> str:
    return str(rnd.randint(100, 999))


def _narrative_fact(rnd: random.Random, key: str) -> Fact:
    n = _value(rnd)
    tellings = (f"The {key} in the old tower was worth {n} coins.",
                f"Everyone in town knew that the {key} was worth {n} coins.",
                f"Again and again people said the {key} was worth {n} coins.")  # fmt: skip
    return Fact(tellings, f"How many coins was the {key} worth?", n, f"The {key} was worth")


def _story(rnd: random.Random) -> str:
    return rnd.choice(_STORY)


def _log_fact(rnd: random.Random, key: str) -> Fact:
    port = _value(rnd)
    lines = tuple(
        f"{rnd.randint(10, 23)}:{rnd.randint(10, 59)} INFO the {key} service is listening on "
        f"port {port}"
        for _ in range(3)
    )
    return Fact(lines, f"Which port is the {key} service listening on?", port,
                f"The {key} service is listening on port")  # fmt: skip


def _log_noise(rnd: random.Random) -> str:
    return f"{rnd.randint(10, 23)}:{rnd.randint(10, 59)} DEBUG heartbeat queue=0 workers=8"


def _table_fact(rnd: random.Random, key: str) -> Fact:
    price = _value(rnd)
    row = f"the {key} costs {price} | stock {_value(rnd)} | shelf {_value(rnd)}"
    return Fact((row,), f"What does the {key} cost?", price, f"The {key} costs")


def _table_noise(rnd: random.Random) -> str:
    return "-" * 8


def _code_fact(rnd: random.Random, key: str) -> Fact:
    value = _value(rnd)
    return Fact((f"{key}_limit = {value}",), f"What value is {key}_limit set to?", value,
                f"{key}_limit =")  # fmt: skip


def _code_noise(rnd: random.Random) -> str:
    fn = rnd.choice(["load", "parse", "check", "build", "merge", "split", "flush", "open"])
    arg = rnd.choice(["path", "items", "config", "buffer", "name", "rows"])
    return (f"def {fn}_{arg}({arg}):\n    \"\"\"{fn.capitalize()} the {arg}.\"\"\"\n"
            f"    if not {arg}:\n        return None\n    return {arg}")  # fmt: skip


def _chat_fact(rnd: random.Random, key: str) -> Fact:
    n = _value(rnd)
    line = f"User: By the way, my {key} number is {n}."
    return Fact((line,), f"What is the user's {key} number?", n, f"The user's {key} number is")


def _chat_noise(rnd: random.Random) -> str:
    speaker = rnd.choice(["User", "Assistant"])
    return f"{speaker}: {rnd.choice(_SMALL_TALK)}"


def _mixture_fact(rnd: random.Random, key: str) -> Fact:
    n = _value(rnd)
    return Fact((f"The {key} weighs {n} grams.",), f"How much does the {key} weigh?", n,
                f"The {key} weighs")  # fmt: skip


def _retold(kind: str, fact: Fact, key: str, times: int, rnd: random.Random) -> Fact:
    """``fact`` told ``times`` times, in the kind's phrasings (the first ``times`` of them)."""
    v = fact.answer
    first = fact.tellings[0]
    phrasings = {
        "narrative": [*fact.tellings, f"Nobody forgot that the {key} was worth {v} coins."],
        "logs": [f"{rnd.randint(10, 23)}:{rnd.randint(10, 59)} INFO the {key} service is "
                 f"listening on port {v}" for _ in range(MAX_TELLINGS)],
        "table": [first, f"the {key} costs {v} | (repeated row)", f"the {key} costs {v} | "
                  "(price checked)", f"the {key} costs {v} | (price confirmed)"],
        "code": [first, f"assert {key}_limit == {v}", f"DEFAULTS['{key}_limit'] = {v}",
                 f"# {key}_limit is {v}"],
        "chat": [first, f"Assistant: Noted, your {key} number is {v}.",
                 f"User: Again, my {key} number is {v}.",
                 f"Assistant: So your {key} number is {v}."],
        "mixture": [first, f"Again, the {key} weighs {v} grams.",
                    f"Everyone knew the {key} weighs {v} grams.",
                    f"Weighed once more, the {key} weighs {v} grams."],
    }[kind]  # fmt: skip
    return Fact(tuple(phrasings[:times]), fact.question, fact.answer, fact.lead)


_FACT_SHARE = {"narrative": 0.6, "logs": 0.8, "table": 0.95, "code": 0.35, "chat": 0.3}
"""Share of the token budget that facts take (``mixture``: by seed, module docstring)."""

_BUILDERS: dict[
    str, tuple[Callable[[random.Random, str], Fact], Callable[[random.Random], str]]
] = {
    "narrative": (_narrative_fact, _story),
    "logs": (_log_fact, _log_noise),
    "table": (_table_fact, _table_noise),
    "code": (_code_fact, _code_noise),
    "chat": (_chat_fact, _chat_noise),
    "mixture": (_mixture_fact, _story),
}
