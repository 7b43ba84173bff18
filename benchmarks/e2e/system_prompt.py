"""The shared system prompt of the end-to-end workload (issue 29 item 5: ``bench_e2e
--system-prompt-tokens N``).

Real serving puts the same system prompt before every conversation; the e2e workload's
documents otherwise differ from their first chunk on. With ``N`` > 0 every prompt is the
model's chat template with a **system message** (deterministic instructions, the same for every
request) and then the user turn as before (document, question). Its head, everything before
the document — ``<|im_start|>system\\n``, the instructions, ``<|im_end|>\\n<|im_start|>user\\n``
for SmolLM2 — is exactly ``N`` tokens of the real tokenizer, so every prompt starts with the
same ``N`` ids and the document starts at token ``N``, tokenized as without a system prompt
(``benchmarks/e2e/e2e_workload.py`` checks both). With ``N`` a multiple of LMCache's chunk size the
prefix is ``N / chunk`` whole chunks shared by every context; otherwise its last partial chunk
is part of each document's first chunk, and only the whole chunks can be shared.

``N = 0`` (the default) is no system message at all: the template's own default system line,
every prompt exactly as before the option existed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

_WHEN = ["When a question names a person", "When the text gives a number",
         "When two passages disagree", "When a question asks for a list",
         "When a name is spelled oddly", "When the document is long",
         "When a date appears in the text", "When a question is ambiguous",
         "When the answer is a city", "When a variable is assigned",
         "When the user repeats a question", "When a fact appears twice"]  # fmt: skip
_DO = ["quote the exact words of the document", "answer in as few words as you can",
       "say which sentence holds the answer", "keep the order the document uses",
       "copy every digit exactly", "do not guess beyond what is written",
       "prefer the most specific statement", "give every value that applies",
       "leave out any explanation", "check the whole text before answering",
       "use the spelling of the document", "answer only what was asked"]  # fmt: skip
_WHY = ["so that answers can be checked", "because readers compare answers with the source",
        "as the archive requires", "to keep replies consistent",
        "since the answers are graded automatically", "for the sake of accuracy"]  # fmt: skip
_OPENING = ("You are a careful assistant who answers questions about the document in the "
            "user's message. Follow the house rules below.")  # fmt: skip


@dataclass(frozen=True, slots=True)
class SystemPrompt:
    """The system message's ``text`` and the ``ids`` every prompt starts with (``len(ids)``
    tokens: the template's markers, the text, the user turn's opening)."""

    text: str
    ids: tuple[int, ...]


def chat_ids(tokenizer: Any, user: str, system: str = "") -> list[int]:
    """The chat prompt's ids for one user turn, after a system message when ``system``."""
    messages = [{"role": "user", "content": user}]
    if system:
        messages.insert(0, {"role": "system", "content": system})
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def head_ids(tokenizer: Any, system: str) -> list[int]:
    """The ids before the user's text, after a system message ``system``: where two prompts
    that differ only in their user text's first token part."""
    a, b = chat_ids(tokenizer, "A", system), chat_ids(tokenizer, "B", system)
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def instructions(tokenizer: Any, tokens: int) -> list[int]:
    """At least ``tokens`` ids of instruction text (deterministic: house rules drawn from a
    fixed seed)."""
    rnd = random.Random("kvtierd-e2e-system-prompt")
    parts = [_OPENING]
    # words only (no numbers: the tokenizer splits " 12" into " " and "12", and a cut between
    # them would not re-tokenize to the same ids), so any cut re-tokenizes as it was
    while len(tokenizer(" ".join(parts), add_special_tokens=False)["input_ids"]) < tokens:
        parts += [f"{rnd.choice(_WHEN)}, {rnd.choice(_DO)}, {rnd.choice(_WHY)}."
                  for _ in range(20)]  # fmt: skip
    return list(tokenizer(" ".join(parts), add_special_tokens=False)["input_ids"])


def system_prompt(tokenizer: Any, tokens: int) -> SystemPrompt | None:
    """The system prompt whose head is exactly ``tokens`` ids (module docstring); ``None`` for
    0. Raises ``ValueError`` for a count the template cannot make (below its own markers + 1)."""
    if tokens == 0:
        return None
    markers = len(head_ids(tokenizer, "x")) - 1  # the template's ids around a one-token text
    if tokens <= markers:
        raise ValueError(
            f"--system-prompt-tokens must be 0 (no system prompt) or more than {markers} (the "
            f"chat template's own markers around a system message take {markers}), got {tokens}"
        )
    body = instructions(tokenizer, tokens - markers)[: tokens - markers]
    text = tokenizer.decode(body).strip()
    ids = head_ids(tokenizer, text)
    if len(ids) != tokens:  # the text re-tokenized differently at the cut: say so, never guess
        raise ValueError(
            f"a system prompt of {tokens} tokens came out as {len(ids)} after the chat "
            f"template; try {tokens + 1}"
        )
    return SystemPrompt(text, tuple(ids))
