"""SASRec's contract (finite, padding-invariant, fast path equal to the full one) and model files."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from recsys.model import sasrec as sasrec_module
from recsys.model.base import SequenceRecommender
from recsys.model.io import load_model, save_model
from recsys.model.sasrec import SASRec, SASRecConfig
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
NUM_ITEMS = 40


def make_model(seed: int = 0, **overrides) -> SASRec:
    torch.manual_seed(seed)
    config = SASRecConfig(num_items=NUM_ITEMS, dim=16, layers=2, heads=2, max_len=8, dropout=0.2)
    model = SASRec(SASRecConfig(**{**config.__dict__, **overrides}))
    with torch.no_grad():  # randomise LayerNorm too, so every parameter matters in a round trip
        for name, p in model.named_parameters():
            if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                p.uniform_(0.5, 1.5)
            elif name.endswith(("ln_1.bias", "ln_2.bias", "ln_f.bias")):
                p.normal_(0, 0.1)
    return model.eval()


def random_batch(batch: int, max_len: int, seed: int = 1) -> torch.Tensor:
    """Left-padded rows of every length from 0 to max_len."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(1, NUM_ITEMS + 1, (batch, max_len), generator=g)
    lengths = torch.arange(batch) % (max_len + 1)
    seq[torch.arange(max_len)[None, :] < (max_len - lengths)[:, None]] = 0
    return seq


# --- the contract -----------------------------------------------------------------------------

def test_sasrec_satisfies_the_scoring_contract():
    model = make_model()
    assert isinstance(model, SequenceRecommender)
    assert (model.max_len, model.num_items) == (8, NUM_ITEMS)
    emb = model.item_embeddings()
    assert emb.shape == (NUM_ITEMS + 1, 16)
    assert emb is model.item_emb.weight  # one table: input embedding and output layer
    assert torch.count_nonzero(emb[0]) == 0  # padding row


def test_encode_equals_last_position_of_full_forward():
    model = make_model()
    seq = random_batch(150, 8)  # more rows than CPU_ENCODE_ROWS, every padding amount
    with torch.no_grad():
        full = model(seq)[:, -1]
        fast = model.encode(seq)
    assert fast.shape == (150, 16)
    torch.testing.assert_close(fast, full, rtol=1e-5, atol=1e-5)


def test_encode_trims_padding_columns_exactly():
    """All rows short: encode drops the all-padding columns, which must not change anything."""
    model = make_model()
    seq = random_batch(40, 8)
    seq[:, :5] = 0
    with torch.no_grad():
        torch.testing.assert_close(model.encode(seq), model(seq)[:, -1], rtol=1e-5, atol=1e-5)


def test_user_vector_does_not_depend_on_the_rest_of_the_batch():
    model = make_model()
    seq = random_batch(70, 8)
    with torch.no_grad():
        together = model.encode(seq)
        alone = torch.cat([model.encode(row[None]) for row in seq])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)


def test_padding_amount_does_not_change_the_user_vector():
    model = make_model()
    items = torch.tensor([5, 17, 3])
    widths = [3, 4, 6, 8]
    with torch.no_grad():
        vectors = [model.encode(torch.cat([torch.zeros(w - 3, dtype=torch.long), items])[None]) for w in widths]
        hidden = [model(torch.cat([torch.zeros(w - 3, dtype=torch.long), items])[None])[:, -3:] for w in widths]
    for v, h in zip(vectors[1:], hidden[1:]):
        torch.testing.assert_close(v, vectors[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(h, hidden[0], rtol=1e-5, atol=1e-5)  # every real position, not just the last


def test_all_padding_and_left_padded_rows_are_finite_in_eval_and_training():
    model = make_model()
    seq = torch.zeros(4, 8, dtype=torch.long)
    seq[1, -1] = 7
    seq[2, -3:] = torch.tensor([1, 2, 3])
    with torch.no_grad():
        assert torch.isfinite(model.encode(seq)).all()
        assert torch.isfinite(model.encode(torch.zeros(3, 8, dtype=torch.long))).all()
        assert torch.isfinite(model(seq)).all()
    model.train()
    out = model(seq)
    out.sum().backward()
    assert torch.isfinite(out).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_no_attention_row_is_fully_masked():
    """Fully masked rows are a softmax over nothing: NaN on torch < 2.5 and on some kernels.
    Recent CPU kernels return zeros instead, so finiteness alone would not catch this."""
    model = make_model()
    seq = random_batch(20, 8)
    seq[0] = 0
    _, mask = model._embed(seq)
    assert mask.any(dim=-1).all()


def test_forward_is_causal():
    model = make_model()
    seq = random_batch(1, 8, seed=3)
    seq[0] = torch.arange(1, 9)
    changed = seq.clone()
    changed[0, 5] = 30
    with torch.no_grad():
        a, b = model(seq), model(changed)
    torch.testing.assert_close(a[:, :5], b[:, :5])
    assert not torch.allclose(a[:, 5:], b[:, 5:])


def test_rejects_sequences_longer_than_max_len():
    with pytest.raises(ValueError, match="max_len=8"):
        make_model().encode(torch.ones(2, 9, dtype=torch.long))


@pytest.mark.parametrize("bad", [dict(num_items=0), dict(dim=10, heads=3), dict(dropout=1.0), dict(layers=0)])
def test_config_rejects_nonsense(bad):
    with pytest.raises(ValueError):
        SASRecConfig(**{"num_items": 5, **bad})


def test_model_and_scoring_core_modules_import_without_spark_mlflow_pydantic_or_yaml():
    code = ("import sys, recsys.model.sasrec, recsys.model.io, recsys.model.training, recsys.model.metrics, "
            "recsys.scoring.core, recsys.sequences, recsys.model.configs\n"
            "bad = [m for m in ('pyspark', 'mlflow', 'pydantic', 'yaml') if m in sys.modules]\n"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env={"PYTHONPATH": str(REPO)})


# --- save / load ------------------------------------------------------------------------------

ITEM_IDS = np.arange(1000, 1000 + NUM_ITEMS, dtype=np.int64)[::-1].copy()


def test_round_trip_gives_identical_user_vectors(tmp_path):
    model = make_model()
    save_model(model, ITEM_IDS, tmp_path / "m", metadata={"val_ndcg@10": 0.25, "run": "abc"})
    loaded = load_model(tmp_path / "m")
    seq = random_batch(20, 8)
    with torch.no_grad():
        assert torch.equal(loaded.model.encode(seq), model.encode(seq))
        assert torch.equal(loaded.model.item_embeddings(), model.item_embeddings())
    assert not loaded.model.training
    assert loaded.model_type == "sasrec" and loaded.config == model.config
    assert loaded.item_ids.dtype == np.int64 and np.array_equal(loaded.item_ids, ITEM_IDS)
    assert loaded.metadata == {"val_ndcg@10": 0.25, "run": "abc"}
    document = json.loads((tmp_path / "m" / "config.json").read_text())
    assert document["format_version"] == 1 and document["model"]["num_items"] == NUM_ITEMS


def test_tied_embedding_is_stored_once(tmp_path):
    save_model(make_model(), ITEM_IDS, tmp_path)
    tensors = load_file(str(tmp_path / "weights.safetensors"))
    tables = [name for name, t in tensors.items() if t.shape == (NUM_ITEMS + 1, 16)]
    assert tables == ["item_emb.weight"]


def test_pickled_weights_are_refused(tmp_path):
    save_model(make_model(), ITEM_IDS, tmp_path)
    torch.save(make_model().state_dict(), tmp_path / "weights.safetensors")  # a pickle under the right name
    with pytest.raises(ValueError, match="safetensors"):
        load_model(tmp_path)


def test_pickled_item_ids_are_refused(tmp_path):
    save_model(make_model(), ITEM_IDS, tmp_path)
    np.save(tmp_path / "item_ids.npy", np.array([str(i) for i in ITEM_IDS], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="item_ids.npy"):
        load_model(tmp_path)


def test_a_directory_with_only_a_pickle_is_refused(tmp_path):
    torch.save(make_model(), tmp_path / "model.pt")
    with pytest.raises(ValueError, match="no config.json"):
        load_model(tmp_path)


def _tamper(directory: Path, **changes) -> None:
    path = directory / "config.json"
    document = json.loads(path.read_text())
    for key, value in changes.items():
        if key in document:
            document[key] = value
        else:
            document["model"][key] = value
    path.write_text(json.dumps(document))


@pytest.mark.parametrize("changes, message", [
    (dict(model_type="bert4rec"), "model_type 'bert4rec'"),
    (dict(model_type="gru4rec"), "unknown gru4rec config fields \\['heads'\\]"),
    (dict(format_version=2), "format_version 2"),
    (dict(dim=32), "shape"),
    (dict(num_items=NUM_ITEMS + 1), "shape"),
    (dict(layers=3), "missing"),
    (dict(colour="blue"), "unknown sasrec config fields"),
    (dict(heads=3), "invalid sasrec config"),
])
def test_tampered_config_fails_clearly(tmp_path, changes, message):
    save_model(make_model(), ITEM_IDS, tmp_path)
    _tamper(tmp_path, **changes)
    with pytest.raises(ValueError, match=message):
        load_model(tmp_path)


def test_item_ids_length_must_match_num_items(tmp_path):
    save_model(make_model(), ITEM_IDS, tmp_path)
    np.save(tmp_path / "item_ids.npy", ITEM_IDS[:-1])
    with pytest.raises(ValueError, match="num_items=40"):
        load_model(tmp_path)


@pytest.mark.parametrize("missing", ["config.json", "weights.safetensors", "item_ids.npy"])
def test_missing_file_fails_clearly(tmp_path, missing):
    save_model(make_model(), ITEM_IDS, tmp_path)
    (tmp_path / missing).unlink()
    with pytest.raises(ValueError, match=f"no {missing}"):
        load_model(tmp_path)


def test_save_rejects_bad_vocabulary_and_metadata(tmp_path):
    model = make_model()
    with pytest.raises(ValueError, match="num_items=40"):
        save_model(model, ITEM_IDS[:-1], tmp_path)
    with pytest.raises(ValueError, match="duplicates"):
        save_model(model, np.zeros(NUM_ITEMS, dtype=np.int64), tmp_path)
    with pytest.raises(ValueError, match="JSON"):
        save_model(model, ITEM_IDS, tmp_path, metadata={"when": object()})


def test_cpu_encode_blocks_do_not_change_results(monkeypatch):
    model = make_model()
    seq = random_batch(33, 8)
    with torch.no_grad():
        monkeypatch.setattr(sasrec_module, "CPU_ENCODE_ROWS", 7)
        blocked = model.encode(seq)
        monkeypatch.setattr(sasrec_module, "CPU_ENCODE_ROWS", 10_000)
        whole = model.encode(seq)
    torch.testing.assert_close(blocked, whole, rtol=1e-5, atol=1e-5)


def trained_model() -> SASRec:
    """A SASRec trained a few epochs on a next-item pattern: trained weights, not an initialisation."""
    from recsys.model.training import TrainSettings, fit
    from recsys.sequences import Sequences

    rng = np.random.default_rng(0)
    runs = [list((s + np.arange(n)) % NUM_ITEMS + 1) for s, n in zip(rng.integers(0, NUM_ITEMS, 200),
                                                                    rng.integers(3, 15, 200))]
    config = SASRecConfig(num_items=NUM_ITEMS, dim=16, layers=2, heads=2, max_len=8, dropout=0.1)
    return fit(Sequences.from_lists(runs), config, TrainSettings(epochs=3, batch_size=32, learning_rate=5e-3, seed=1,
                                                                 num_threads=1)).model.eval()


def test_encode_matches_the_full_encoder_on_a_trained_model(monkeypatch):
    """The scoring encoder (length-sorted blocks, last position only, no mask in unpadded blocks)
    against the full forward's last position: float tolerance, on trained weights."""
    model = trained_model()
    full_rows = random_batch(128, 8, seed=4)
    full_rows[full_rows == 0] = 3                                  # 128 unpadded rows: two unmasked blocks
    seq = torch.cat([random_batch(90, 8, seed=5), full_rows])[torch.randperm(218, generator=torch.Generator().manual_seed(0))]
    unmasked = []
    original = sasrec_module.Block.forward_last

    def spy(self, x, mask):
        unmasked.append(mask is None)
        return original(self, x, mask)

    monkeypatch.setattr(sasrec_module.Block, "forward_last", spy)
    with torch.no_grad():
        fast = model.encode(seq)
        reference = model(seq)[:, -1]
    torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-5)
    assert sum(unmasked) >= 2 and not all(unmasked)                # both paths ran


def test_attention_under_cpu_bf16_autocast_runs_in_fp32_and_returns_bf16():
    """The scoring core's bf16 autocast on the CPU: attention itself is computed from the bf16 inputs
    in fp32 (faster there at these sizes, and exact), and hands bf16 on to the next projection."""
    from recsys.model.sasrec import _attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(8, 2, 12, 16, generator=g).bfloat16() for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _attention(q, k, v, is_causal=True)
    assert out.dtype == torch.bfloat16
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert torch.equal(out, expected.bfloat16())
