"""The end-to-end benchmark's workload and client (``bench_e2e.py``).

**Contexts** are the quality benchmark's documents (``quality_tasks.py``): ``n`` cases cycling
over the tasks and the lengths, each with its questions (the main one, other keys or people,
rephrasings). **Requests** pick a context by Zipf popularity (rank ``r`` has weight
``1 / r**s``; which context gets which rank is shuffled by the seed) and one of its questions
uniformly. **Arrivals** follow the Azure LLM inference trace (``benchmarks/data``, CC-BY, Patel
et al. ISCA 2024): its inter-arrival gaps in order from a seeded start, scaled so that the mean
rate is ``qps`` — the trace has no prompt text or context identity, so only its burstiness is
used (how requests map to contexts is the Zipf choice above; DESIGN.md §4 asks to say so).

With ``--workload kinds`` (issue 39) the contexts are instead documents of the kinds in
``benchmarks/quality/context_kinds.py`` (narrative and logs, whose facts recur; tables, code,
chat and mixtures, whose facts are told once): contexts that differ in how much compression
they keep their answers through. A request asks one of the document's questions, and its
prompt ends with the question's ``lead`` (the reply's first words, "The apple was worth")
after the chat template opens the assistant's turn: the request path sends token ids to
``/v1/completions``, so the reply continues the lead and the answer is the value in a few
tokens, as the labels of ``context_labels.py`` ask it. The lengths and the popularity, the
questions' choice and the arrivals follow the same rules as the default workload (``tasks``).

With ``--system-prompt-tokens N`` (``system_prompt.py``) every prompt starts with the same
``N``-token system prompt and then the document as before: the contexts then share a prefix,
as real serving's do (issue 29). ``N = 0`` (default) leaves every prompt exactly as it was.

The **client** sends each request at its arrival time (open loop: a slow system queues, as a
real one would), streamed, as token ids (the chat template applied here, so every system sees
the same prompt), and records the time to the first generated text (TTFT, at the client), the
answer and the router's ``x-kvtierd-context`` header.
"""

from __future__ import annotations

import asyncio
import csv
import itertools
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from benchmarks.e2e.system_prompt import SystemPrompt, system_prompt
from benchmarks.quality.context_kinds import KINDS, KindCase, make_kind_case
from benchmarks.quality.quality_tasks import TASKS, Case, make_case, split_prompt

# Kept in the repository with its attribution (data/README.md): a clone anywhere reads it.
TRACE = Path(__file__).resolve().parents[1] / "data" / "AzureLLMInferenceTrace_conv.csv"


@dataclass(frozen=True, slots=True)
class Request:
    """The ``index``-th request: context ``context`` asked question ``question`` at ``at_s``."""

    index: int
    at_s: float
    context: int
    question: int


@dataclass(frozen=True, slots=True)
class Prompt:
    ids: tuple[int, ...]
    context_tokens: int
    answers: tuple[str, ...]


def length_class(context: int, lengths: list[int]) -> int:
    """The length (tokens) :func:`make_contexts` and :func:`make_kind_contexts` asked for
    context ``context`` (one rule for both workloads: every ``len(TASKS)`` contexts the next
    length; with six kinds beside five steps, 30 contexts give every kind every length)."""
    return lengths[(context // len(TASKS)) % len(lengths)]


def make_contexts(tokenizer: Any, n: int, lengths: list[int], seed: int = 0) -> list[Case]:
    """``n`` documents, tasks and lengths interleaved so that every length has every task."""
    out = []
    for i in range(n):
        task = TASKS[i % len(TASKS)]
        out.append(make_case(tokenizer, task, length_class(i, lengths), 1000 * seed + i))
    return out


def make_kind_contexts(tokenizer: Any, n: int, lengths: list[int], seed: int = 0) -> list[KindCase]:
    """``n`` documents of the kinds of ``context_kinds.py`` in turn (module docstring), each
    of :func:`length_class`'s length, seeded as :func:`make_contexts` seeds its cases."""
    return [make_kind_case(tokenizer, KINDS[i % len(KINDS)], length_class(i, lengths),
                           1000 * seed + i) for i in range(n)]  # fmt: skip


def prompts(
    tokenizer: Any, contexts: list[Case], chunk_tokens: int, system_tokens: int = 0
) -> list[list[Prompt]]:
    """Per context, per question: the prompt ids, the context length and the answers; with
    ``system_tokens`` > 0 every prompt starts with the same system prompt of that many tokens
    (``system_prompt.py``; ``ValueError`` for a count it cannot make), the context counting it."""
    system = system_prompt(tokenizer, system_tokens)
    return [[_prompt(tokenizer, case, chunk_tokens, question, answers, system=system)
             for question, answers in case.questions] for case in contexts]  # fmt: skip


def kind_prompts(
    tokenizer: Any, contexts: list[KindCase], chunk_tokens: int, system_tokens: int = 0
) -> list[list[Prompt]]:
    """:func:`prompts` for documents of ``context_kinds.py``: each question's prompt ends with
    its lead's ids after the assistant's turn opens (module docstring); the answer expected is
    the question's value."""
    system = system_prompt(tokenizer, system_tokens)
    table = []
    for kc in contexts:
        row = []
        for question, lead, answer in kc.questions:
            case = Case(kc.kind, kc.length, kc.seed, kc.document, question, (answer,), 0.0)
            asked = _prompt(tokenizer, case, chunk_tokens, question, (answer,), system=system)
            lead_ids = tokenizer(lead, add_special_tokens=False)["input_ids"]
            row.append(Prompt((*asked.ids, *lead_ids), asked.context_tokens, asked.answers))
        table.append(row)
    return table


def _prompt(
    tokenizer: Any, case: Case, chunk_tokens: int, question: str, answers: tuple[str, ...], *,
    system: SystemPrompt | None,
) -> Prompt:  # fmt: skip
    split = split_prompt(tokenizer, case, chunk_tokens, question,
                         system=system.text if system else "")  # fmt: skip
    if system and split.ids[: len(system.ids)] != system.ids:  # never a silent mismatch
        raise ValueError(f"{case.name}: its prompt does not start with the "
                         f"{len(system.ids)}-token system prompt")  # fmt: skip
    return Prompt(split.ids, split.context_tokens, answers)


@dataclass(frozen=True, slots=True)
class Documents:
    """A workload's contexts (:func:`make_documents`) and, per context and question, its
    prompt."""

    contexts: tuple[Case, ...] | tuple[KindCase, ...]
    table: list[list[Prompt]]


class _MakeDocuments(Protocol):
    def __call__(
        self, tokenizer: Any, *, n: int, lengths: list[int], seed: int, chunk_tokens: int,
        system_tokens: int,
    ) -> Documents: ...  # fmt: skip


def _tasks(
    tokenizer: Any, *, n: int, lengths: list[int], seed: int, chunk_tokens: int,
    system_tokens: int,
) -> Documents:  # fmt: skip
    cases = make_contexts(tokenizer, n, lengths, seed)
    return Documents(tuple(cases), prompts(tokenizer, cases, chunk_tokens, system_tokens))


def _kinds(
    tokenizer: Any, *, n: int, lengths: list[int], seed: int, chunk_tokens: int,
    system_tokens: int,
) -> Documents:  # fmt: skip
    cases = make_kind_contexts(tokenizer, n, lengths, seed)
    return Documents(tuple(cases), kind_prompts(tokenizer, cases, chunk_tokens, system_tokens))


WORKLOADS: dict[str, _MakeDocuments] = {"tasks": _tasks, "kinds": _kinds}
"""The workloads by ``--workload`` name (module docstring): ``tasks`` is the default."""


def make_documents(
    tokenizer: Any, workload: str, *, n: int, lengths: list[int], seed: int, chunk_tokens: int,
    system_tokens: int = 0,
) -> Documents:  # fmt: skip
    """``workload``'s ``n`` contexts and their prompts; ``ValueError`` for an unknown name (or
    a system prompt :func:`prompts` cannot make)."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")
    return WORKLOADS[workload](tokenizer, n=n, lengths=lengths, seed=seed,
                               chunk_tokens=chunk_tokens, system_tokens=system_tokens)  # fmt: skip


def check_fits(
    table: list[list[Prompt]], *, max_model_len: int, max_tokens: int, system_tokens: int
) -> None:
    """Raise ``ValueError`` unless every prompt and its ``max_tokens`` answer fit vLLM's
    ``max_model_len`` (naming the limit, the longest prompt and the largest system prompt that
    would fit)."""
    longest = max(len(p.ids) for row in table for p in row)
    if longest + max_tokens <= max_model_len:
        return
    room = max_model_len - max_tokens - (longest - system_tokens)
    raise ValueError(
        f"the longest prompt is {longest} tokens ({system_tokens} of system prompt) and its "
        f"answer up to {max_tokens}: more than the {max_model_len} tokens of max_model_len "
        f"bench_e2e serves the model with; at these --lengths the system prompt can be at "
        f"most {max(room, 0)} tokens (--system-prompt-tokens), or use shorter --lengths"
    )


def distinct_context_tokens(table: list[list[Prompt]], shared_tokens: int) -> int:
    """Tokens of KV the contexts hold between them: each context's, less the ``shared_tokens``
    every context starts with (whole chunks of a system prompt), which are stored once."""
    own = sum(row[0].context_tokens - shared_tokens for row in table)
    return own + shared_tokens


def trace_gaps(path: Path = TRACE) -> list[float]:
    """Inter-arrival gaps (s) of the Azure trace, in order."""
    with path.open() as f:
        stamps = [_stamp(row["TIMESTAMP"]) for row in csv.DictReader(f)]
    return [b - a for a, b in itertools.pairwise(stamps)]


def _stamp(text: str) -> float:
    # "2023-11-16 18:15:46.6805900": seven fractional digits, more than fromisoformat takes
    head, _, frac = text.partition(".")
    return datetime.fromisoformat(head).timestamp() + float(f"0.{frac or 0}")


def make_requests(
    contexts: Sequence[Case | KindCase], *, num: int, qps: float, zipf_s: float, seed: int,
    gaps: list[float],
) -> list[Request]:  # fmt: skip
    """``num`` requests: Zipf contexts, uniform questions, trace arrivals at mean rate ``qps``."""
    rnd = random.Random(seed)
    ranks = list(range(len(contexts)))
    rnd.shuffle(ranks)  # ranks[i]: the popularity rank of context i
    weights = [1.0 / (ranks[i] + 1) ** zipf_s for i in range(len(contexts))]
    start = rnd.randrange(max(1, len(gaps) - num))
    window = gaps[start : start + num]
    scale = (1.0 / qps) / (sum(window) / len(window))
    at, out = 0.0, []
    for i in range(num):
        c = rnd.choices(range(len(contexts)), weights)[0]
        q = rnd.randrange(len(contexts[c].questions))
        out.append(Request(i, at, c, q))
        at += window[i] * scale
    return out


@dataclass(frozen=True, slots=True)
class Outcome:
    index: int
    context: int
    question: int
    sent_s: float  # from the start of the run
    ttft_s: float
    total_s: float
    answer: str
    served_from: str  # x-kvtierd-context, "" for the real prompt
    error: str = ""
    prompt_tokens: int = 0  # vLLM's usage (the prompt as served: placeholders + suffix)
    cached_tokens: int = -1  # of them, cached or loaded (-1: vLLM did not say)

    @property
    def kind(self) -> str:
        """``variant`` (served from a token-dropped variant), ``miss`` (at most a quarter of
        the prompt cached: a prefill), ``hit`` or ``unknown``."""
        if self.served_from:
            return "variant"
        if self.cached_tokens < 0:
            return "unknown"
        return "miss" if self.cached_tokens <= 0.25 * self.prompt_tokens else "hit"

    def kind_behind(self, shared_tokens: int) -> str:
        """:attr:`kind` in a workload whose prompts start with ``shared_tokens`` of a shared
        system prompt (its whole chunks): ``miss`` when vLLM did not load all of those,
        ``prefix`` when it loaded them and at most a quarter of the rest (the document
        prefilled), else ``hit``. With no shared tokens, :attr:`kind`."""
        kind = self.kind
        if shared_tokens == 0 or kind in ("variant", "unknown"):
            return kind
        if self.cached_tokens < shared_tokens:
            return "miss"
        own = self.cached_tokens - shared_tokens
        return "prefix" if own <= 0.25 * (self.prompt_tokens - shared_tokens) else "hit"


async def run_requests(
    url: str, model: str, table: list[list[Prompt]], requests: list[Request], *,
    max_tokens: int, progress: Any = None,
) -> list[Outcome]:  # fmt: skip
    """Send every request at its time; the outcomes in request order."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()

        async def one(r: Request) -> Outcome:
            await asyncio.sleep(max(0.0, r.at_s - (time.perf_counter() - t0)))
            body = {"model": model, "prompt": list(table[r.context][r.question].ids),
                    "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            out = await _send(session, f"{url}/v1/completions", body, r, t0)
            if progress is not None:
                progress(out)
            return out

        return list(await asyncio.gather(*(one(r) for r in requests)))


async def _send(session: Any, url: str, body: dict[str, Any], r: Request, t0: float) -> Outcome:
    """One streamed request; ``t0``: the run's start (``perf_counter``)."""
    sent = time.perf_counter()
    first, parts, header, error = 0.0, [], "", ""
    usage: dict[str, Any] = {}
    try:
        async with session.post(url, json=body) as resp:
            header = resp.headers.get("x-kvtierd-context", "")
            if resp.status != 200:
                error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if not event.get("choices"):  # the usage event (stream_options.include_usage)
                    usage = event.get("usage") or {}
                    continue
                text = event["choices"][0].get("text", "")
                if text and not first:
                    first = time.perf_counter() - sent
                parts.append(text)
    except (TimeoutError, OSError, ValueError) as e:
        error = f"{type(e).__name__}: {e}"
    total = time.perf_counter() - sent
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return Outcome(r.index, r.context, r.question, sent - t0, first or total, total,
                   "".join(parts).strip(), header, error, int(usage.get("prompt_tokens", 0)),
                   cached if isinstance(cached, int) else -1)  # fmt: skip
