"""The architecture matrix: tiny random causal LMs of every supported family, built from
configs (no download), plus the families that layer removal must refuse.

One table (:data:`FAMILIES`) feeds the parametrized tests in ``tests/test_architectures.py``
and the support table of ``docs/architectures.md`` (``python tests/arch_matrix.py`` prints
it as markdown; ``tests/test_docs.py`` checks the page shows it), so the table lists exactly
what the tests exercise.

Every model has :data:`NUM_BLOCKS` blocks, hidden size 32, vocabulary 128, fp32, eager
attention. Per-layer settings are chosen so that removal and plans have something to get
wrong: sliding and full attention interleaved (window 4, shorter than the test prompts),
NoPE layers, MoE and dense MLP blocks mixed.

This is the one table of tiny models: the unit tests' ``tiny_model("llama" | "qwen3" |
"gemma3")`` of ``tests/conftest.py`` are the rows ``llama``, ``qwen3`` and ``gemma3_text``,
built with the few settings that file names as overrides (every row's builder takes
``num_blocks`` and config fields that replace the row's own).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: Blocks in every matrix model.
NUM_BLOCKS = 6
#: The two removal sets every family is checked with: non-contiguous and contiguous.
REMOVAL_SETS = {"noncontiguous": (1, 3), "contiguous": (2, 3)}
#: Sliding window of the models that have one (shorter than the test prompts).
WINDOW = 4
VOCAB = 128

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def alternating_types(n: int, first: str = "sliding_attention") -> list[str]:
    """``layer_types`` of ``n`` blocks alternating sliding and full attention, starting with ``first``."""
    other = "full_attention" if first == "sliding_attention" else "sliding_attention"
    return [first if i % 2 == 0 else other for i in range(n)]


def _gemma3_types(n: int) -> list[str]:
    """Gemma-3's pattern: every third block full attention, the others sliding."""
    return ["full_attention" if i % 3 == 2 else "sliding_attention" for i in range(n)]


def _fields(overrides: dict, **row) -> dict:
    """A row's config fields: :data:`_COMMON`, then the row's own, then the caller's overrides."""
    return {**_COMMON, **row, **overrides}


def _llama(n, **kw):
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=n, **_fields(kw))


def _mistral(n, **kw):
    from transformers import MistralConfig

    return MistralConfig(num_hidden_layers=n, **_fields(kw, sliding_window=WINDOW))


def _qwen2(n, **kw):
    from transformers import Qwen2Config

    # max_window_layers=2: blocks 0-1 full, 2.. sliding (the Qwen2 threshold rule)
    return Qwen2Config(
        num_hidden_layers=n, **_fields(kw, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)
    )


def _qwen3(n, **kw):
    from transformers import Qwen3Config

    return Qwen3Config(
        num_hidden_layers=n,
        **_fields(
            kw, head_dim=8, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=n // 2,
            layer_types=alternating_types(n),
        ),
    )


def _qwen3_moe(n, **kw):
    from transformers import Qwen3MoeConfig

    # sparse blocks where (i + 1) % 2 == 0 and i not in mlp_only_layers: 1, 5 (3 is forced dense)
    return Qwen3MoeConfig(
        num_hidden_layers=n,
        **_fields(
            kw, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=2,
            mlp_only_layers=[3],
        ),
    )


def _gemma2(n, **kw):
    from transformers import Gemma2Config

    return Gemma2Config(
        num_hidden_layers=n, **_fields(kw, head_dim=8, sliding_window=WINDOW, layer_types=alternating_types(n))
    )


def _gemma3_text(n, **kw):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        num_hidden_layers=n, **_fields(kw, head_dim=8, sliding_window=WINDOW, layer_types=_gemma3_types(n))
    )


def _gemma3_multimodal(n, **kw):
    from transformers import Gemma3Config, SiglipVisionConfig

    vision = SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=8
    )
    # image/boi/eoi ids inside the tiny vocabulary but never used by the test prompts; overrides go to the text tower
    return Gemma3Config(
        text_config=_gemma3_text(n, **kw).to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
        image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2,
    )


def _phi3(n, **kw):
    from transformers import Phi3Config

    return Phi3Config(num_hidden_layers=n, **_fields(kw, pad_token_id=0))


def _gpt2(n, **kw):
    from transformers import GPT2Config

    return GPT2Config(n_layer=n, **{**dict(n_embd=32, n_head=4, n_positions=64, vocab_size=VOCAB), **kw})


def _gpt_neox(n, **kw):
    from transformers import GPTNeoXConfig

    row = dict(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, max_position_embeddings=64, vocab_size=VOCAB
    )
    return GPTNeoXConfig(num_hidden_layers=n, **{**row, **kw})


def _opt(n, **kw):
    from transformers import OPTConfig

    row = dict(
        hidden_size=32, ffn_dim=64, num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
        vocab_size=VOCAB, pad_token_id=0,
    )
    return OPTConfig(num_hidden_layers=n, **{**row, **kw})


def _olmo2(n, **kw):
    from transformers import Olmo2Config

    return Olmo2Config(num_hidden_layers=n, **_fields(kw, pad_token_id=0))


def _smollm3(n, **kw):
    from transformers import SmolLM3Config

    # NoPE every 3rd block: no_rope_layers = [1, 1, 0, 1, 1, 0]
    return SmolLM3Config(num_hidden_layers=n, **_fields(kw, no_rope_layer_interval=3, pad_token_id=0))


def _gemma3n(n, num_kv_shared_layers=2):
    from transformers import Gemma3nTextConfig

    return Gemma3nTextConfig(
        num_hidden_layers=n, head_dim=8, sliding_window=WINDOW, num_kv_shared_layers=num_kv_shared_layers,
        hidden_size_per_layer_input=4,
        vocab_size_per_layer_input=VOCAB, laurel_rank=4, altup_num_inputs=2, intermediate_size=[64] * n,
        layer_types=alternating_types(n), activation_sparsity_pattern=[0.0] * n,
        **{k: v for k, v in _COMMON.items() if k != "intermediate_size"},
    )


def _bart(n, causal=True):
    from transformers import BartConfig

    # default-style config: encoder and decoder of equal depth, so a wrong field goes unnoticed
    return BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=n, decoder_layers=n, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        is_encoder_decoder=not causal,
    )


@dataclass(frozen=True)
class Family:
    """One architecture of the matrix.

    Attributes:
        name: short id used in test ids.
        label: the name in the support table.
        config: ``(num_blocks, **overrides) -> config`` builder; an override replaces
            the row's value of that config field.
        per_layer_fields: per-layer config lists this family has (filtered on removal,
            permuted under a plan).
        index_fields: index-valued config fields remapped on removal.
        block_list: dotted path of the decoder's ``nn.ModuleList`` (documentation and a check).
        notes: what is special about the family (support table column).
    """

    name: str
    label: str
    config: Callable[..., object]
    per_layer_fields: tuple[str, ...] = ()
    index_fields: tuple[str, ...] = ()
    block_list: str = "model.layers"
    notes: str = ""


FAMILIES: tuple[Family, ...] = (
    Family("llama", "Llama", _llama),
    Family("mistral", "Mistral", _mistral, notes=f"sliding window {WINDOW} on every block"),
    Family(
        "qwen2", "Qwen2", _qwen2, ("layer_types",), ("max_window_layers",),
        notes="sliding/full from the max_window_layers threshold",
    ),
    Family(
        "qwen3", "Qwen3", _qwen3, ("layer_types",), ("max_window_layers",), notes="interleaved sliding/full layer_types"
    ),
    Family(
        "qwen3_moe", "Qwen3-MoE", _qwen3_moe, (), ("mlp_only_layers", "decoder_sparse_step"),
        notes="MoE and dense blocks mixed (decoder_sparse_step=2, mlp_only_layers=[3])",
    ),
    Family("gemma2", "Gemma2", _gemma2, ("layer_types",), notes="interleaved sliding/full, soft-capping"),
    Family("gemma3_text", "Gemma3 (text)", _gemma3_text, ("layer_types",), notes="sliding/full, per-type RoPE"),
    Family(
        "gemma3_mm", "Gemma3 (multimodal, text tower)", _gemma3_multimodal, ("layer_types",),
        block_list="model.language_model.layers", notes="Gemma3ForConditionalGeneration; text_config surgery",
    ),
    Family("phi3", "Phi-3", _phi3, notes="fused qkv/gate_up projections"),
    Family("gpt2", "GPT-2", _gpt2, block_list="transformer.h", notes="n_layer alias; learned positions"),
    Family("gpt_neox", "GPT-NeoX (Pythia)", _gpt_neox, block_list="gpt_neox.layers", notes="partial rotary"),
    Family("opt", "OPT", _opt, block_list="model.decoder.layers", notes="learned positions"),
    Family("olmo2", "OLMo-2", _olmo2, notes="post-norm blocks, q/k norm"),
    Family(
        "smollm3", "SmolLM3", _smollm3, ("layer_types", "no_rope_layers"),
        notes="per-layer no_rope_layers (NoPE every 3rd block)",
    ),
)

FAMILY_BY_NAME = {f.name: f for f in FAMILIES}


@dataclass(frozen=True)
class RefusedFamily:
    """A configuration that layer removal must refuse, and the words the error must contain."""

    name: str
    label: str
    config: Callable[[int], object]
    error_names: tuple[str, ...]
    reason: str = field(default="")


REFUSED: tuple[RefusedFamily, ...] = (
    RefusedFamily(
        "gpt2_inverse_scale", "GPT-2 with scale_attn_by_inverse_layer_idx=True",
        lambda n: _gpt2(n, scale_attn_by_inverse_layer_idx=True), ("scale_attn_by_inverse_layer_idx",),
        "attention scale fixed from the layer index at construction",
    ),
    RefusedFamily(
        "gemma3n", "Gemma3n (text)", _gemma3n, ("num_kv_shared_layers", "hidden_size_per_layer_input"),
        "KV sharing between layers and per-layer input embeddings are indexed by layer",
    ),
    RefusedFamily(
        "gemma3n_no_kv_sharing", "Gemma3n (text, no KV sharing)", lambda n: _gemma3n(n, num_kv_shared_layers=0),
        ("hidden_size_per_layer_input", "intermediate_size", "activation_sparsity_pattern"),
        "per-layer input embeddings and per-layer lists this library does not filter",
    ),
    RefusedFamily(
        "bart_causal", "BART decoder (BartForCausalLM)", _bart, ("decoder_layers",),
        "num_hidden_layers is an alias of encoder_layers, not the decoder depth",
    ),
    RefusedFamily(
        "bart", "BART (encoder-decoder)", lambda n: _bart(n, causal=False), ("is_encoder_decoder",),
        "encoder-decoder models are not supported",
    ),
)


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Run torch on one intra-op thread, then restore. Matrices this small gain nothing from
    a second thread, and on a busy 2-core machine the threads' spin-waits make every
    forward tens of times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build(
    family: Family | RefusedFamily | str,
    num_blocks: int = NUM_BLOCKS,
    seed: int = 0,
    dtype: torch.dtype | None = torch.float32,
    **overrides,
):
    """A tiny random model of ``family`` in eval mode, eager attention, its weights drawn
    after ``torch.manual_seed(seed)``. ``dtype`` is passed to ``from_config`` (``None``
    leaves it out, so the config records no dtype); ``overrides`` replace config fields of
    the row (not for :data:`REFUSED`)."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    if isinstance(family, str):
        family = FAMILY_BY_NAME.get(family) or next(f for f in REFUSED if f.name == family)
    torch.manual_seed(seed)
    cfg = family.config(num_blocks, **overrides)
    auto = AutoModelForSeq2SeqLM if getattr(cfg, "is_encoder_decoder", False) else AutoModelForCausalLM
    model = auto.from_config(cfg, attn_implementation="eager", dtype=dtype)
    return model.eval()


def prompts(
    batch: int = 2, length: int = 10, seed: int = 1, pad_last: int = 2, high: int = VOCAB - 4
) -> dict[str, torch.Tensor]:
    """Right-padded random prompts ``(batch, length)``: the last row has ``pad_last``
    padding positions (id 0), the other ids are drawn from ``1 .. high - 1``. The default
    ``high`` avoids the top 4 vocabulary entries (the multimodal model's image/boi/eoi
    tokens)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, high, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    if pad_last:
        mask[-1, length - pad_last :] = 0
        ids[-1, length - pad_last :] = 0
    return {"input_ids": ids, "attention_mask": mask}


def tiny_tokenizer(pad_token: bool = True):
    """A character-level fast tokenizer over printable ASCII (ids 4..98 < :data:`VOCAB`), built
    in memory. No BOS/EOS is added, so ``"a"`` is exactly one token. ``pad_token=False``
    gives a tokenizer with no pad token (like many causal LM tokenizers)."""
    import string

    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<s>", "</s>"]
    chars = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    special = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
    if pad_token:
        special["pad_token"] = "<pad>"
    return PreTrainedTokenizerFast(tokenizer_object=backend, **special)


_SIMPLE = (bool, int, float, str, type(None))


def block_signature(block: torch.nn.Module) -> list[tuple]:
    """What a block was built as, apart from its position: for each submodule its name,
    class, parameter shapes and its scalar settings (sliding window, layer type, NoPE,
    scaling...), with ``layer_idx`` left out. Two blocks with equal signatures compute
    the same function of their weights."""
    out = []
    for name, module in block.named_modules():
        settings = tuple(
            sorted(
                (k, v)
                for k, v in vars(module).items()
                if not k.startswith("_") and k != "layer_idx" and isinstance(v, _SIMPLE)
            )
        )
        shapes = tuple((n, tuple(p.shape)) for n, p in module.named_parameters(recurse=False))
        out.append((name, type(module).__name__, shapes, settings))
    return out


#: The checks of ``tests/test_architectures.py`` run on every family: (test function, column).
CHECKS: tuple[tuple[str, str], ...] = (
    ("test_scoring_restores_model_exactly", "scoring restores exactly"),
    ("test_removal_keeps_model_and_config_consistent", "layer_idx, per-layer lists, index fields, params"),
    ("test_generate_dynamic_static_and_no_cache_agree", "generate: dynamic = static = no cache"),
    ("test_plain_transformers_reload_gives_identical_logits", "plain-transformers reload"),
    ("test_block_keeps_its_attention_type_under_a_plan", "moved blocks keep their type"),
)


def support_table(families=FAMILIES, refused=REFUSED, checks=CHECKS) -> str:
    """Markdown table of the families and the checks ``tests/test_architectures.py`` runs on
    each (removal sets {1, 3} and {2, 3} of 6 blocks), then the configurations it refuses."""
    header = ["Family", "Decoder blocks", "Per-layer config handled"] + [label for _, label in checks]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for fam in families:
        fields = ", ".join(f"`{x}`" for x in fam.per_layer_fields + fam.index_fields) or "none"
        rows.append(f"| {fam.label} | `{fam.block_list}` | {fields} | " + " | ".join(["yes"] * len(checks)) + " |")
    for ref in refused:
        names = ", ".join(f"`{x}`" for x in ref.error_names)
        cells = ["refused"] + [f"error names {names}: {ref.reason}"] + ["-"] * len(checks)
        rows.append(f"| {ref.label} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _dotted(model, path: str):
    obj = model
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def check_block_list(model, family: Family) -> bool:
    """True when ``family.block_list`` names the list :func:`decoder_blocks` finds."""
    from hf_layerswap.layerplan import decoder_blocks

    return _dotted(model, family.block_list) is decoder_blocks(model)[2]


if __name__ == "__main__":  # print the support table of docs/architectures.md
    print(support_table())
    assert all(re.fullmatch(r"[a-z0-9_]+", f.name) for f in FAMILIES)
