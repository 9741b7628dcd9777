"""scoring.dtype=int8: refused where the CPU cannot run it, fp32 scores where it runs, and the int8 item
matrix built once per model load.

The refusals run on every machine: the CPU is presented through the capability check's own seam
(``recsys.model.precision.cpu_capabilities``, and oneDNN's ``ONEDNN_MAX_CPU_ISA``), and the scoring
core decides. The tests that score in int8 need a CPU with AMX-INT8, AVX-512-VNNI or AVX-VNNI and
are skipped elsewhere, where the path cannot run at all.
"""
import json

import numpy as np
import pyarrow as pa
import pytest
import torch

from recsys.data.contracts import HISTORY_COLUMN, SOURCE_POPULARITY
from recsys.model import int8 as int8_module
from recsys.model import precision
from recsys.scoring import core as core_module
from recsys.scoring.core import Candidates, Fallback, Scorer, UnsupportedDtype, check_dtype
from recsys.sequences import Sequences, Vocabulary, pad_left
from test_scoring_core import ITEM_IDS, NUM_ITEMS, to_ids, trained_sasrec

XEON_WITHOUT_VNNI = {"avx2": True, "avx512_f": True, "avx512_bw": True, "avx512_vnni": False, "amx_int8": False}
EPYC_WITH_VNNI = {"avx2": True, "avx512_f": True, "avx512_vnni": True, "amx_int8": False}
int8_cpu = pytest.mark.skipif(not precision.cpu_int8_supported(),
                              reason=f"int8 scoring cannot run here: {precision.cpu_int8_refusal()}")


def _scorer(model, dtype="int8", available=None, **kw) -> Scorer:
    available = np.arange(1, NUM_ITEMS + 1) if available is None else available
    fb = Fallback(SOURCE_POPULARITY, ITEM_IDS[:10], np.linspace(1, 0.5, 10).astype(np.float32))
    return Scorer(model=model, vocab=Vocabulary(ITEM_IDS), candidates=Candidates(available, ITEM_IDS[available - 1]),
                  fallback=fb, top_n=kw.pop("top_n", 10), device=torch.device("cpu"), dtype=dtype, **kw)


def _histories(n=200, seed=5):
    rng = np.random.default_rng(seed)
    return [list(rng.choice(np.arange(1, NUM_ITEMS + 1), size=k, replace=False)) for k in rng.integers(1, 20, n)]


@pytest.fixture(scope="module")
def model():
    return trained_sasrec()


# --- refusal: every machine ------------------------------------------------------------------------

def test_int8_is_refused_on_a_cpu_without_integer_dot_products(monkeypatch):
    """The flags of an AVX-512 CPU without VNNI or AMX-INT8: the core refuses, naming the flags and the fix."""
    monkeypatch.setattr(precision, "cpu_capabilities", lambda: XEON_WITHOUT_VNNI)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert not precision.cpu_int8_supported()
    with pytest.raises(UnsupportedDtype, match=r"scoring\.dtype=int8 needs a CPU with AMX-INT8, AVX-512-VNNI or "
                                               r"AVX-VNNI.*Use scoring\.dtype=float32"):
        _scorer(_tiny_model())


def test_int8_is_refused_where_onednn_is_held_below_vnni(monkeypatch):
    """A CPU that has VNNI, but oneDNN held to AVX2 on this worker: the kernels could not use it."""
    if "onednn" not in torch.backends.quantized.supported_engines:
        pytest.skip("this torch has no oneDNN quantized engine (refused for that reason instead)")
    monkeypatch.setattr(precision, "cpu_capabilities", lambda: EPYC_WITH_VNNI)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")
    with pytest.raises(UnsupportedDtype, match=r"ONEDNN_MAX_CPU_ISA=AVX2 holds oneDNN below"):
        check_dtype("int8", torch.device("cpu"))
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_VNNI")     # a cap that keeps VNNI
    check_dtype("int8", torch.device("cpu"))


def test_int8_is_for_cpus_only():
    with pytest.raises(UnsupportedDtype, match=r"scoring\.dtype=int8 is for CPUs.*use bfloat16 or float16"):
        check_dtype("int8", torch.device("cuda"))


def test_the_int8_check_reads_the_cpu_flags():
    """Where /proc/cpuinfo lists amx_int8, avx512_vnni or avx_vnni (and oneDNN is not capped), int8 is supported."""
    try:
        flags = open("/proc/cpuinfo").read().split()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    has = any(f in flags for f in ("amx_int8", "avx512_vnni", "avx_vnni"))
    engine = torch.backends.mkldnn.is_available() and "onednn" in torch.backends.quantized.supported_engines
    capped = precision.cpu_int8_refusal().startswith("ONEDNN_MAX_CPU_ISA")
    assert precision.cpu_int8_supported() == (has and engine and not capped)


def _tiny_model():
    from toy_model import random_model

    return random_model(NUM_ITEMS)


# --- the int8 path: CPUs that run it ----------------------------------------------------------------

@int8_cpu
def test_int8_scores_are_fp32_dot_products_of_the_user_vector_and_the_fp32_items(model):
    """Every published score is the fp32 product of the (int8-encoded) user vector and the item's fp32
    row, never an int8 approximation; lists are best first, masked items and seen items left out."""
    hists = _histories()
    scorer = _scorer(model)
    ids, vals, fallback, _ = scorer.topn(to_ids(hists))
    assert vals.dtype == np.float32 and not fallback.any()
    seq = torch.as_tensor(pad_left(Sequences.from_lists(hists), model.max_len))
    with torch.inference_mode():
        users = scorer.int8.encoder.encode(seq)                                        # [U, D] as the core encodes
        emb = model.item_embeddings().detach()
    index = np.searchsorted(ITEM_IDS, ids) + 1                                         # model index of each item
    expected = torch.einsum("ukd,ud->uk", emb[torch.as_tensor(index)], users).numpy()
    np.testing.assert_allclose(vals, expected, rtol=1e-5, atol=1e-6)
    assert np.all(np.diff(vals, axis=1) <= 0)
    for hist, row in zip(hists, index):
        assert not set(hist) & set(row.tolist())


@int8_cpu
def test_with_an_fp32_encoder_int8_publishes_the_fp32_cores_scores_for_the_same_items(model, monkeypatch):
    """The int8 product only preselects: the same items get the fp32 core's scores, to float tolerance."""
    monkeypatch.setattr(core_module, "INT8_ENCODER", False)
    hists = _histories(seed=6)
    ids32, vals32, _, _ = _scorer(model, dtype="float32").topn(to_ids(hists))
    ids8, vals8, _, _ = _scorer(model).topn(to_ids(hists))
    same = 0
    for a, va, b, vb in zip(ids32, vals32, ids8, vals8):
        common, ia, ib = np.intersect1d(a, b, return_indices=True)
        np.testing.assert_allclose(vb[ib], va[ia], rtol=1e-5, atol=1e-6)
        same += len(common)
    assert same / ids32.size >= 0.99                       # and they are nearly all the same items


@int8_cpu
def test_int8_lists_overlap_fp32_on_a_trained_model(model):
    hists = _histories(seed=7)
    ids32, _, _, _ = _scorer(model, dtype="float32").topn(to_ids(hists))
    ids8, _, _, _ = _scorer(model).topn(to_ids(hists))
    overlap = np.mean([len(np.intersect1d(a, b)) / 10 for a, b in zip(ids32, ids8)])
    assert overlap >= 0.95


@int8_cpu
def test_int8_over_item_tiles_gives_the_untiled_lists(model):
    hists = _histories(seed=8)
    whole = _scorer(model).topn(to_ids(hists))
    tiled_scorer = _scorer(model, item_tile=7)
    assert len(tiled_scorer._int8_tiles) == -(-NUM_ITEMS // 7)
    tiled = tiled_scorer.topn(to_ids(hists))
    assert np.array_equal(whole[0], tiled[0])
    np.testing.assert_allclose(whole[1], tiled[1], rtol=1e-6)


@int8_cpu
def test_int8_encoder_quantizes_the_chosen_layers_and_shares_the_embeddings(model):
    q = int8_module.quantize_encoder(model)
    kinds = {name: type(m).__name__ for name, m in q.named_modules() if name.endswith(("qkv", "proj", "fc"))}
    assert kinds == {"blocks.0.attn.qkv": "Int8Linear", "blocks.0.attn.proj": "Linear", "blocks.0.mlp.fc": "Linear",
                     "blocks.0.mlp.proj": "Linear", "blocks.1.attn.qkv": "Int8Linear", "blocks.1.attn.proj": "Linear",
                     "blocks.1.mlp.fc": "Linear", "blocks.1.mlp.proj": "Linear"}
    both = int8_module.quantize_encoder(model, ("attn.qkv", "mlp.fc"))      # the choice is a parameter
    assert isinstance(both.blocks[1].mlp.fc, int8_module.Int8Linear)
    assert q.item_emb is model.item_emb                                    # not a copy of the table
    assert isinstance(model.blocks[0].attn.qkv, torch.nn.Linear)           # the original is untouched
    seq = torch.as_tensor(pad_left(Sequences.from_lists(_histories(50)), model.max_len))
    with torch.inference_mode():
        a, b = model.encode(seq), q.encode(seq)
    assert torch.nn.functional.cosine_similarity(a, b).min() > 0.999


# --- built once per model load: the worker cache's figures ------------------------------------------

@int8_cpu
@pytest.mark.spark
def test_the_int8_item_matrix_is_built_once_per_model_load(spark, tmp_path, model):
    """Three tasks on one worker (this process): two candidate sets, then the first again. The model is
    loaded once and quantized once (int8_misses 1); each new candidate set only packs its rows."""
    from recsys.model.io import save_model
    from recsys.scoring.params import ScoringParams
    from recsys.scoring.shipping import ship_model
    from recsys.scoring.udf import STATS_COLUMN, ScoringSpec, make_partition_scorer

    shipped = ship_model(spark, save_model(model, ITEM_IDS, tmp_path / "model"), name="int8-test", version="1",
                         scratch=tmp_path / "driver")
    hists = _histories(30)
    batch = pa.record_batch({"user_id": pa.array(np.arange(30, dtype=np.int64)),
                             HISTORY_COLUMN: pa.array([ITEM_IDS[np.asarray(h) - 1].tolist() for h in hists],
                                                      pa.list_(pa.int64()))})

    def spec(available: np.ndarray, digest: str) -> ScoringSpec:
        return ScoringSpec(model=shipped, model_version="1", candidates_index=available,
                           candidates_item_ids=ITEM_IDS[available - 1], candidates_digest=digest,
                           fallback_item_ids=ITEM_IDS[:10], fallback_scores=np.linspace(1, 0.5, 10).astype(np.float32),
                           fallback_name=SOURCE_POPULARITY,
                           params=ScoringParams(top_n=10, chunk_size=16, device="cpu", dtype="int8"))

    def task(s: ScoringSpec) -> dict:
        out = list(make_partition_scorer(s)(iter([batch])))
        assert sum(b.num_rows for b in out[:-1]) == 30
        return json.loads(out[-1].column(STATS_COLUMN)[0].as_py())

    threads = torch.get_num_threads()
    try:
        first = task(spec(np.arange(1, NUM_ITEMS + 1), "all"))
        second = task(spec(np.arange(1, NUM_ITEMS + 1, 2), "odd"))
        third = task(spec(np.arange(1, NUM_ITEMS + 1), "all"))
    finally:
        torch.set_num_threads(threads)
    assert (first["model_misses"], first["int8_misses"], first["scorer_misses"]) == (1, 1, 1)
    assert first["int8_build_s"] > 0
    assert (second["model_misses"], second["int8_misses"], second["int8_hits"], second["scorer_misses"]) == (0, 0, 1, 1)
    assert (third["scorer_hits"], third["int8_misses"], third["int8_hits"]) == (1, 0, 0)   # the whole scorer cached


@int8_cpu
def test_a_model_with_no_layer_to_quantize_keeps_its_encoder_and_the_fp32_scores():
    """GRU4Rec: nothing in its encoder is quantized (the same module, not a copy); only the product runs
    in int8, so the published scores of the items both cores list are the fp32 core's."""
    from recsys.model.gru4rec import GRU4Rec, GRU4RecConfig

    torch.manual_seed(0)
    gru = GRU4Rec(GRU4RecConfig(num_items=NUM_ITEMS, dim=16, layers=1, max_len=8, dropout=0.0)).eval()
    assert int8_module.quantize_encoder(gru) is gru
    hists = _histories(seed=10)
    ids32, vals32, _, _ = _scorer(gru, dtype="float32").topn(to_ids(hists))
    ids8, vals8, _, _ = _scorer(gru).topn(to_ids(hists))
    for a, va, b, vb in zip(ids32, vals32, ids8, vals8):
        _, ia, ib = np.intersect1d(a, b, return_indices=True)
        np.testing.assert_allclose(vb[ib], va[ia], rtol=1e-5, atol=1e-6)
    assert np.mean([len(np.intersect1d(a, b)) / 10 for a, b in zip(ids32, ids8)]) >= 0.99
