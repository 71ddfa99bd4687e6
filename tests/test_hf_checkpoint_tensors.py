"""Which stored tensors a HF checkpoint's model is built from, where transformers versions disagree:
a tied config (``tie_word_embeddings: true``) that still stores an ``lm_head.weight``.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_hf_checkpoint_tensors.py -q``
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from csbp.models import Decoder, DecoderConfig, export_hf_checkpoint, load_hf_checkpoint  # noqa: E402

CONFIG = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4, num_kv_heads=2,
                       head_dim=8, tie_embeddings=True)


def tied_export_with_head(tmp_path: Path, head: torch.Tensor | None) -> Path:
    out = export_hf_checkpoint(Decoder(CONFIG, seed=3), CONFIG, tmp_path / "tied")
    tensors = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" not in tensors
    if head is not None:
        tensors["lm_head.weight"] = head
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_a_tied_checkpoint_storing_a_copy_of_the_embedding_loads(tmp_path: Path) -> None:
    plain = load_hf_checkpoint(tied_export_with_head(tmp_path / "a", None))[0]
    embedding = plain.embed_tokens.weight.detach().clone()
    copied = load_hf_checkpoint(tied_export_with_head(tmp_path / "b", embedding))[0]
    assert torch.equal(copied.embed_tokens.weight, embedding)


def test_a_tied_checkpoint_storing_another_head_is_refused(tmp_path: Path) -> None:
    """csbp used the embedding as the head (transformers 4's reading); transformers 5 uses the stored
    head untied, so the checkpoint means two models and is refused naming both fixes."""
    head = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    out = tied_export_with_head(tmp_path, head)
    with pytest.raises(ValueError, match=r"tie_word_embeddings=true but it stores an lm_head.weight that differs"):
        load_hf_checkpoint(out)
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) >= 5:  # the reading csbp would have disagreed with
        transformers.logging.set_verbosity_error()
        hf = transformers.AutoModelForCausalLM.from_pretrained(out)
        assert torch.equal(hf.lm_head.weight, head) and not torch.equal(hf.model.embed_tokens.weight, head)
