"""When the daemon can write a token-dropped variant in the form vLLM loads (engine/servable.py),
and the model card that carries the model's rope to it (kernels/placeholder.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtierd.engine.servable import (
    Servability,
    ServableForm,
    agreed_prefix,
    load_cards,
    save_card,
    servable_form_of,
)
from kvtierd.errors import InvalidArgumentError
from kvtierd.kernels.chunk_codec import ChunkFormat
from kvtierd.kernels.placeholder import ModelCard, lmcache_model, model_rope
from kvtierd.kernels.rope import RopeSpec
from kvtierd.profiler.queries import QueryStore
from kvtierd.router_protocol import context_digest
from kvtierd.types import ObjectMeta

MODEL, T, H, D = "/m/llama", 16, 2, 32
CARD = ModelCard(MODEL, D, RopeSpec.standard(D).inv_freq, 1000, (0,))


def chunks(count: int, tokens: int = T, model: str = MODEL) -> list[ObjectMeta]:
    layout = ChunkFormat((2, 2, tokens, H * D), "bfloat16", H).layout()
    return [
        ObjectMeta(key=f"{model}@1@0@{i:x}@bfloat16", size_bytes=1, layout=layout)
        for i in range(count)
    ]


def test_lmcache_model_reads_the_key_and_refuses_other_keys() -> None:
    assert lmcache_model("/a@b/model@1@0@ff@bfloat16") == "/a@b/model"
    assert lmcache_model("doc/0") == "" and lmcache_model("@1@0@ff@bf16") == ""


def test_model_card_round_trip_and_rope() -> None:
    assert ModelCard.from_bytes(CARD.to_bytes()) == CARD
    assert CARD.rope() == RopeSpec.standard(D)
    with pytest.raises(InvalidArgumentError, match="ALiBi"):
        ModelCard(MODEL, refused="ALiBi position biases").rope()
    with pytest.raises(InvalidArgumentError, match="model card is not valid"):
        ModelCard.from_bytes(b'{"model": "x"}')


def test_cards_are_kept_in_the_data_dir(tmp_path: Path) -> None:
    save_card(str(tmp_path), CARD)
    save_card(str(tmp_path), ModelCard("other", refused="no"))
    (tmp_path / "model_cards" / "bad.json").write_text("{")
    assert load_cards(str(tmp_path)) == {MODEL: CARD, "other": ModelCard("other", refused="no")}
    assert load_cards(str(tmp_path / "none")) == {}


@pytest.mark.parametrize(
    ("originals", "agreed", "cards", "variant", "why"),
    [
        ([ObjectMeta(key="doc/0", size_bytes=1)], 64, {MODEL: CARD}, "knorm@0.5", "not LMCache"),
        (chunks(4), 64, {}, "knorm@0.5", f"no model card for {MODEL}"),
        (chunks(4), 64, {MODEL: ModelCard(MODEL, refused="M-RoPE")}, "knorm@0.5", "M-RoPE"),
        (chunks(4), 15, {MODEL: CARD}, "knorm@0.5", "no token ids agreed for its first chunk"),
        # pages of 5: 64 tokens keep the 4 trailing ones + 6 pages = 34, not whole chunks
        (chunks(4), 64, {MODEL: CARD}, "paged_eviction_block-page=5@0.5", "not whole chunks"),
        # no profiling.model_dir (a policy naming snapkv without one is refused at parse)
        (chunks(4), 64, {MODEL: CARD}, "snapkv@0.5", "Set profiling.model_dir"),
    ],
)
def test_reasons_a_variant_cannot_be_served_yet(
    originals: list[ObjectMeta], agreed: int, cards: dict[str, ModelCard], variant: str, why: str
) -> None:
    form = servable_form_of(variant, originals, agreed, cards)
    assert isinstance(form, str) and why in form, form


def test_the_form_covers_the_agreed_whole_chunks() -> None:
    form = servable_form_of("knorm@0.5", chunks(4), 3 * T + 5, {MODEL: CARD})
    assert form == ServableForm(MODEL, 3 * T, 3, T, H, 2 * T, CARD)  # 24 -> 2 whole chunks
    # a chunk of another size ends the run of leading chunks
    mixed = chunks(2) + chunks(1, tokens=8)
    assert isinstance(f := servable_form_of("knorm@0.5", mixed, 100, {MODEL: CARD}), ServableForm)
    assert (f.num_chunks, f.num_tokens) == (2, 2 * T)


def test_agreed_prefix() -> None:
    assert agreed_prefix([1, 2, 3, 4], [1, 2, 9]) == 2
    assert agreed_prefix([1, 2], [1, 2, 3]) == 2 and agreed_prefix([], [1]) == 0


def test_prompts_that_differ_narrow_the_agreed_prefix_and_the_digest_follows() -> None:
    queries, s = QueryStore(None), Servability({MODEL: CARD})
    first, second = list(range(70)), [*range(40), 999, 998]
    for prompt in (first, second):
        # one prompt does not say where the context ends: the document, or it and a question
        assert s.agreed("c", queries) == 0
        s.agree("c", queries, prompt, prompt=True)
        queries.set_tokens("c", prompt)
    assert s.agreed("c", queries) == 40
    form = s.form("c", "knorm@0.5", chunks(4), queries)
    assert (form.num_tokens, form.digest) == (2 * T, context_digest(MODEL, first[: 2 * T]))
    assert s.options("c", "none", ["int8", "knorm@0.5"], chunks(4), queries) == [
        "int8", "knorm@0.5",
    ]  # fmt: skip
    s.agree("e", queries, list(range(50)), prompt=False)  # ids given as the context's own
    assert s.agreed("e", queries) == 50
    assert s.options("d", "none", ["int8", "knorm@0.5"], chunks(4), queries) == ["int8"]
    assert "no token ids" in s.why["d"] and "c" not in s.why
    # the form a context is stored in stays among its options
    assert s.options("d", "knorm@0.5", ["knorm@0.5"], chunks(4), queries) == ["knorm@0.5"]
    with pytest.raises(InvalidArgumentError, match=r"knorm@0\.5 cannot be served: no token ids"):
        s.form("d", "knorm@0.5", chunks(4), queries)


def test_the_card_of_a_model_the_plugin_refuses_says_why() -> None:
    config = {"model_type": "bloom", "num_attention_heads": 4, "hidden_size": 64,
              "vocab_size": 100}  # fmt: skip
    with pytest.raises(InvalidArgumentError, match="ALiBi"):
        model_rope(config)


def test_a_snapkv_form_names_the_model_and_its_window_of_ids() -> None:
    """snapkv's form carries the policy's model_dir and the last ``window`` ids of the ``N``
    tokens it covers (not of the prompt), whose queries the daemon recomputes (window.py)."""
    queries, s = QueryStore(None), Servability({MODEL: CARD}, lambda: "/m/checkpoint")
    ids = list(range(100, 100 + 3 * T + 5))  # the prompt runs 5 tokens past 3 chunks
    s.agree("c", queries, ids, prompt=False)
    queries.set_tokens("c", ids)
    for variant, window in (("snapkv@0.5", 3 * T), ("snapkv-window=8@0.5", 8)):
        form = s.form("c", variant, chunks(4), queries)
        assert (form.num_tokens, form.model_dir) == (3 * T, "/m/checkpoint")
        assert form.window_ids == tuple(ids[3 * T - window : 3 * T])  # window 64 > N = 48
    assert s.form("c", "knorm@0.5", chunks(4), queries).window_ids == ()
