"""quantkit/gguf/reference_quants.py against llama.cpp's own Q2_K / Q3_K / Q4_K / Q5_K / Q6_K and IQ4_NL / IQ4_XS
quantizers, byte for byte.

Three references, with and without an importance (imatrix) vector:
- always: a line-by-line Python transcription of the C (tests/kquants_transcription.py) on fresh random
  tensors of several kinds (Gaussian, heavy-tailed, mixed sub-block scales with constant / one-signed /
  zero sub-blocks, tiny values whose fp16 scales underflow, and the EDGE_CASES: rounding ties, sparse,
  outliers, 1e4 and 1e-40 magnitudes, an integer grid);
- always: bytes that ggml itself wrote (tests/data/gguf_kquants_ggml.npz, made by this file's
  write_fixture from libggml-base.so's ggml_quantize_chunk; IQ4_NL / IQ4_XS have no transcription, only
  ggml's bytes);
- where a llama.cpp build is at hand (QUANTKIT_LLAMA_CPP_BIN holding libggml-base.so, called through
  ctypes, or a static build's libggml-base.a, linked into a small driver with the C compiler):
  ggml_quantize_chunk on larger random tensors. Skipped, saying why, without one (failed when
  QUANTKIT_TEST_LLAMA_CPP=required).

Regenerate the fixture: QUANTKIT_LLAMA_CPP_BIN=/path/to/bin python tests/test_gguf_reference_quants.py
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantkit.gguf import reference_quants as R
from quantkit.gguf import blocks as gguf_blocks
from quantkit.gguf.grids import dequantize_blocks
from quantkit.gguf.types import GGML_TYPES

if __package__:
    from . import kquants_transcription as KT
else:  # run as a script to write the fixture
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import kquants_transcription as KT

KINDS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
#: the non-uniform types (no line-by-line transcription of their C in kquants_transcription.py: they are checked
#: against ggml's bytes, the fixture's and a llama.cpp build's)
IQ4_KINDS = ("IQ4_NL", "IQ4_XS")
QUANTIZE = {kind: getattr(R, f"quantize_{kind.lower()}") for kind in KINDS + IQ4_KINDS}
FIELDS = {kind: getattr(R, f"{kind.lower()}_fields") for kind in KINDS}
PACK = {kind: getattr(gguf_blocks, f"pack_{kind.lower()}") for kind in KINDS}
FIXTURE = Path(__file__).parent / "data" / "gguf_kquants_ggml.npz"
DISTRIBUTIONS = ("gauss", "heavy", "mixed", "tiny")
#: corner cases: rounding ties, mostly zeros, rare outliers, far from 1 in both directions, an integer grid
EDGE_CASES = ("ties", "sparse", "outlier", "large", "subnormal", "int_grid")


def sample(dist: str, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """A float32 [N, K] weight of one of DISTRIBUTIONS or EDGE_CASES."""
    x = torch.randn(n, k, generator=g)
    edge = {"ties": lambda: torch.round(x * 8) / 8 * 0.01,
            "sparse": lambda: x * (torch.rand(n, k, generator=g) < 0.05) * 0.05,
            "outlier": lambda: x * 0.01 + (torch.rand(n, k, generator=g) < 1 / 256) * 10.0,
            "large": lambda: x * 1e4,
            "subnormal": lambda: x * 1e-40,
            "int_grid": lambda: torch.round(x * 4).clamp(-8, 7)}
    if dist in edge:
        return edge[dist]()
    if dist == "gauss":
        return x * 0.05
    if dist == "heavy":  # a scale mixture: occasional outliers 10-100x the bulk
        return x * 0.02 * torch.exp(1.2 * torch.randn(n, k, generator=g))
    if dist == "tiny":  # the super-block scales underflow fp16 (to subnormals and to 0)
        return x * 1e-6 * torch.exp2(torch.randint(-12, 0, (n, k // 32), generator=g).float()).repeat_interleave(32, 1)
    # mixed: a scale per sub-block of 16 from 2^-10 to 2^3, and special sub-blocks of 32
    x = x.reshape(n, k // 16, 16) * torch.exp2(torch.randint(-10, 4, (n, k // 16, 1), generator=g).float())
    x = x.reshape(n, k // 32, 32)
    kind = torch.randint(0, 8, (n, k // 32), generator=g)
    x[kind == 0] = 0.0
    x[kind == 1] = x[kind == 1].abs()  # one-signed: the min clamps to 0
    x[kind == 2] = -x[kind == 2].abs()
    x[kind == 3] = -0.25  # constant
    return x.reshape(n, k)


def sample_importance(k: int, g: torch.Generator) -> torch.Tensor:
    """A [K] imatrix-like vector: mean squares of activations, log-normal, with zero stretches."""
    imp = torch.exp(2.0 * torch.randn(k, generator=g))
    start = int(torch.randint(0, k - 48, (1,), generator=g))
    imp[start:start + 40] = 0.0
    return imp


def blocks_equal(kind: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """bool [blocks]: which blocks of two [N, G*bytes] arrays are identical."""
    size = GGML_TYPES[kind].block_bytes
    return (a.reshape(-1, size) == b.reshape(-1, size)).all(axis=1)


def assert_same_blocks(kind: str, ours: np.ndarray, theirs: np.ndarray, what: str) -> None:
    assert ours.shape == theirs.shape, (what, ours.shape, theirs.shape)
    same = blocks_equal(kind, ours, theirs)
    bad = np.where(~same)[0]
    assert same.all(), f"{kind} {what}: {bad.size} of {same.size} blocks differ (first {bad[:5]})"


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), dist=st.sampled_from(DISTRIBUTIONS + EDGE_CASES), imatrix=st.booleans())
def test_port_matches_the_c_transcription(seed, dist, imatrix):
    g = torch.Generator().manual_seed(seed)
    w = sample(dist, 2, 512, g)
    imp = sample_importance(512, g) if imatrix else None
    for kind in KINDS:
        ours = QUANTIZE[kind](w, imp).numpy()
        theirs = KT.quantize(kind, w.numpy(), None if imp is None else imp.numpy())
        assert_same_blocks(kind, ours, theirs, f"{dist} seed {seed} imatrix {imatrix}")


def _fixture() -> dict:
    if not FIXTURE.is_file():
        pytest.fail(f"missing {FIXTURE}: regenerate it with `python {Path(__file__).name}` (see the docstring)")
    with np.load(FIXTURE) as z:
        return dict(z)


@pytest.mark.parametrize("imatrix", [False, True], ids=["ref", "imatrix"])
@pytest.mark.parametrize("kind", KINDS + IQ4_KINDS)
def test_port_matches_bytes_ggml_wrote(kind, imatrix):
    fx = _fixture()
    w, imp = torch.from_numpy(fx["w"]), torch.from_numpy(fx["importance"]) if imatrix else None
    key = kind + ("_imatrix" if imatrix else "")
    assert_same_blocks(kind, QUANTIZE[kind](w, imp).numpy(), fx[key], f"fixture {key}")


def test_the_transcription_matches_bytes_ggml_wrote():
    """The slow reference is itself llama.cpp's (so the random-input test above tests against the C)."""
    fx = _fixture()
    for kind in KINDS:
        assert_same_blocks(kind, KT.quantize(kind, fx["w"]), fx[kind], "transcription")
        assert_same_blocks(kind, KT.quantize(kind, fx["w"], fx["importance"]), fx[kind + "_imatrix"],
                           "transcription imatrix")


@pytest.mark.parametrize("shape", [(1, 256), (3, 768), (2, 1024), (0, 512)])
@pytest.mark.parametrize("kind", KINDS)
def test_fields_are_the_packs_arguments(kind, shape):
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    n, k = shape
    w = sample("mixed", n, k, g)
    for imp in (None, sample_importance(k, g)):
        fields = FIELDS[kind](w, imp)
        if kind in ("Q3_K", "Q6_K"):
            q, d, sc = fields
            top, sc_top = (4, 32) if kind == "Q3_K" else (32, 128)
            assert q.dtype == torch.int8 and q.shape == (n, k)
            assert n == 0 or -top <= int(q.min()) <= int(q.max()) <= top - 1
            assert d.dtype == torch.float16 and d.shape == (n, k // 256)
            assert sc.dtype == torch.int8 and sc.shape == (n, k // 16)
            assert n == 0 or -sc_top <= int(sc.min()) <= int(sc.max()) <= sc_top - 1
        else:
            u, d, dmin, sc, mn = fields
            top, group, field_top = {"Q2_K": (3, 16, 15), "Q4_K": (15, 32, 63), "Q5_K": (31, 32, 63)}[kind]
            assert u.dtype == torch.uint8 and u.shape == (n, k) and (n == 0 or int(u.max()) <= top)
            assert d.dtype == dmin.dtype == torch.float16 and d.shape == dmin.shape == (n, k // 256)
            for t in (sc, mn):
                assert t.dtype == torch.uint8 and t.shape == (n, k // group) and (n == 0 or int(t.max()) <= field_top)
        assert torch.equal(PACK[kind](*fields), QUANTIZE[kind](w, imp))


@pytest.mark.parametrize("shape", [(1, 256), (3, 768), (0, 512)])
@pytest.mark.parametrize("kind", IQ4_KINDS)
def test_iq4_fields_are_the_packs_arguments(kind, shape):
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    n, k = shape
    w = sample("mixed", n, k, g)
    for imp in (None, sample_importance(k, g)):
        fields = getattr(R, f"{kind.lower()}_fields")(w, imp)
        u, d = fields[:2]
        assert u.dtype == torch.uint8 and u.shape == (n, k) and (n == 0 or int(u.max()) <= 15)
        assert d.dtype == torch.float16 and d.shape == (n, k // GGML_TYPES[kind].block)
        if kind == "IQ4_XS":
            sc = fields[2]
            assert sc.dtype == torch.int8 and sc.shape == (n, k // 32)
            assert n == 0 or -32 <= int(sc.min()) <= int(sc.max()) <= 31
        assert torch.equal(getattr(gguf_blocks, f"pack_{kind.lower()}")(*fields), QUANTIZE[kind](w, imp))


@pytest.mark.parametrize("kind, bound", [("Q2_K", 0.36), ("Q3_K", 0.19), ("Q4_K", 0.12), ("Q5_K", 0.06),
                                         ("Q6_K", 0.03), ("IQ4_NL", 0.11), ("IQ4_XS", 0.11)])
def test_dequantized_weights_are_close(kind, bound):
    """A sanity bound on what the quantizers are for: relative RMS error of a Gaussian weight (Q2_K ~0.3,
    Q3_K ~0.15, Q4_K ~0.09, Q5_K ~0.045, Q6_K ~0.02, IQ4_NL / IQ4_XS ~0.09 measured), with and without
    importance; and the importance lowers the importance-weighted error."""
    g = torch.Generator().manual_seed(11)
    w = sample("gauss", 16, 1024, g)
    imp = torch.exp(2.0 * torch.randn(1024, generator=g))
    errs = {}
    for name, im in (("ref", None), ("imatrix", imp)):
        y = dequantize_blocks(QUANTIZE[kind](w, im), kind)
        assert float((y - w).pow(2).mean().sqrt() / w.pow(2).mean().sqrt()) < bound, name
        errs[name] = float(((y - w).pow(2) * imp).sum())
    assert errs["imatrix"] < errs["ref"]


def test_refusals():
    w = torch.randn(2, 512)
    with pytest.raises(ValueError, match="super-block size 256"):
        R.quantize_q4_k(torch.randn(2, 320))
    with pytest.raises(ValueError, match=r"float tensor \[N, K\]"):
        R.quantize_q6_k(torch.randn(512))
    with pytest.raises(ValueError, match=r"float tensor \[N, K\]"):
        R.q5_k_fields(torch.zeros(2, 512, dtype=torch.int32))
    with pytest.raises(ValueError, match="NaN or inf"):
        R.quantize_q4_k(torch.full((1, 256), float("inf")))
    with pytest.raises(ValueError, match=r"importance must be a tensor \[K\]"):
        R.quantize_q4_k(w, torch.ones(256))
    with pytest.raises(ValueError, match="non-negative"):
        R.quantize_q5_k(w, -torch.ones(512))
    with pytest.raises(ValueError, match="finite"):
        R.quantize_q6_k(w, torch.full((512,), float("nan")))


# ------------------------------------------------------------------------------------------ real ggml

#: a driver for a static libggml-base.a (no headers needed: the two prototypes of ggml.h it calls)
DRIVER_C = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
size_t ggml_row_size(int type, int64_t ne);
size_t ggml_quantize_chunk(int type, const float * src, void * dst, int64_t start, int64_t nrows,
                           int64_t n_per_row, const float * imatrix);
/* usage: TYPE N K W.f32 IMATRIX.f32|- OUT: writes ggml_quantize_chunk's bytes */
int main(int argc, char ** argv) {
    if (argc != 7) return 2;
    int type = atoi(argv[1]);
    int64_t n = atoll(argv[2]), k = atoll(argv[3]);
    float * w = malloc(sizeof(float) * n * k), * imp = NULL;
    FILE * f = fopen(argv[4], "rb");
    if (!f || fread(w, sizeof(float), n * k, f) != (size_t) (n * k)) return 3;
    fclose(f);
    if (argv[5][0] != '-') {
        imp = malloc(sizeof(float) * k);
        f = fopen(argv[5], "rb");
        if (!f || fread(imp, sizeof(float), k, f) != (size_t) k) return 4;
        fclose(f);
    }
    size_t size = ggml_row_size(type, k) * n;
    void * out = malloc(size);
    size_t got = ggml_quantize_chunk(type, w, out, 0, n, k, imp);
    f = fopen(argv[6], "wb");
    if (!f || got != size || fwrite(out, 1, size, f) != size) return 5;
    fclose(f);
    return 0;
}
"""


def ggml_quantizer(workdir: Path):
    """ggml_quantize_chunk as a function (kind, w float32 [N, K], importance [K] | None) -> uint8 [N, K/256*bytes],
    from the llama.cpp build in QUANTKIT_LLAMA_CPP_BIN: its libggml-base.so through ctypes, or its static
    libggml-base.a linked into a small driver with the C compiler. returns a str (why not) when neither."""
    folder = os.environ.get("QUANTKIT_LLAMA_CPP_BIN")
    if not folder:
        return "QUANTKIT_LLAMA_CPP_BIN is not set (a llama.cpp build folder with libggml-base.so or libggml-base.a)"
    shared = next((Path(folder) / n for n in ("libggml-base.so", "libggml-base.dylib") if (Path(folder) / n).is_file()),
                  None)
    if shared is not None:
        lib = ctypes.CDLL(str(shared))
        lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                            ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]

        def run(kind, w, importance=None):
            w = np.ascontiguousarray(w, np.float32)
            out = np.zeros((w.shape[0], w.shape[1] // GGML_TYPES[kind].block * GGML_TYPES[kind].block_bytes),
                           np.uint8)
            imp = None if importance is None else np.ascontiguousarray(importance, np.float32)
            written = lib.ggml_quantize_chunk(GGML_TYPES[kind].type_id, w.ctypes.data, out.ctypes.data, 0, w.shape[0],
                                              w.shape[1], None if imp is None else imp.ctypes.data)
            assert written == out.size
            return out
        return run
    static = Path(folder) / "libggml-base.a"
    cc = shutil.which(os.environ.get("CC", "cc"))
    if not static.is_file() or cc is None:
        return (f"no libggml-base.so nor libggml-base.a (with a C compiler) in QUANTKIT_LLAMA_CPP_BIN={folder!r}; "
                "CI's .ci/llama_cpp_build copies neither")
    (workdir / "driver.c").write_text(DRIVER_C)
    driver = workdir / "ggml_quantize"
    # -no-pie: a static llama.cpp build's objects are not position independent
    cmd = [cc, "-O2", "-no-pie", str(workdir / "driver.c"), str(static), "-o", str(driver), "-lstdc++", "-lm",
           "-fopenmp", "-lpthread"]
    built = subprocess.run(cmd, capture_output=True, text=True)
    if built.returncode:
        return f"linking a driver against {static} failed: {built.stderr[-400:]}"

    def run(kind, w, importance=None):
        w = np.ascontiguousarray(w, np.float32)
        (workdir / "w.f32").write_bytes(w.tobytes())
        imp = "-"
        if importance is not None:
            (workdir / "imp.f32").write_bytes(np.ascontiguousarray(importance, np.float32).tobytes())
            imp = str(workdir / "imp.f32")
        subprocess.run([str(driver), str(GGML_TYPES[kind].type_id), str(w.shape[0]), str(w.shape[1]), str(workdir / "w.f32"),
                        imp, str(workdir / "out.bin")], check=True)
        out = np.frombuffer((workdir / "out.bin").read_bytes(), np.uint8).copy()
        return out.reshape(w.shape[0], -1)
    return run


@pytest.fixture(scope="module")
def ggml(tmp_path_factory):
    quantize = ggml_quantizer(tmp_path_factory.mktemp("ggml"))
    if isinstance(quantize, str):
        if os.environ.get("QUANTKIT_TEST_LLAMA_CPP") == "required":
            pytest.fail(f"QUANTKIT_TEST_LLAMA_CPP=required but {quantize}")
        pytest.skip(quantize)
    return quantize


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_port_matches_llama_cpps_ggml(ggml, dist):
    gguf = pytest.importorskip("gguf")
    g = torch.Generator().manual_seed(DISTRIBUTIONS.index(dist) + 100)
    for n, k in ((16, 1024), (5, 2560)):
        w = sample(dist, n, k, g)
        imp = sample_importance(k, g)
        for kind in KINDS + IQ4_KINDS:
            for im in (None, imp):
                theirs = ggml(kind, w.numpy(), None if im is None else im.numpy())
                assert_same_blocks(kind, QUANTIZE[kind](w, im).numpy(), theirs,
                                   f"{dist} {n}x{k} imatrix {im is not None}")
                # and the layouts' dequantizer reads ggml's bytes as the gguf package does
                ref = gguf.quants.dequantize(theirs, getattr(gguf.GGMLQuantizationType, kind))
                assert np.array_equal(ref, dequantize_blocks(torch.from_numpy(theirs), kind).numpy())


@pytest.mark.parametrize("dist", EDGE_CASES)
def test_port_matches_llama_cpps_ggml_on_corner_cases(ggml, dist):
    """Corner-case weights, with no importance, an imatrix-like one, a peaked one and an all-zero one."""
    g = torch.Generator().manual_seed(EDGE_CASES.index(dist) + 200)
    n, k = 8, 1024
    w = sample(dist, n, k, g)
    peaked = torch.where(torch.arange(k) % 97 == 0, 1e6, 1e-6)
    for name, imp in (("none", None), ("imatrix", sample_importance(k, g)), ("peaked", peaked),
                      ("zero", torch.zeros(k))):
        for kind in KINDS + IQ4_KINDS:
            theirs = ggml(kind, w.numpy(), None if imp is None else imp.numpy())
            assert_same_blocks(kind, QUANTIZE[kind](w, imp).numpy(), theirs, f"{dist} importance {name}")


def test_iq4_nl_port_matches_ggml_on_widths_of_blocks_of_32(ggml):
    """IQ4_NL on widths that are whole blocks of 32 but no super-block (IQ4_XS's fallback there), with fresh
    random weights each run (an all-zero block included), with and without an importance."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    for n, k in ((7, 96), (3, 320), (1, 32)):
        w = sample("heavy", n, k, g)
        w[0, :32] = 0.0
        for imp in (None, torch.exp(2.0 * torch.randn(k, generator=g))):
            theirs = ggml("IQ4_NL", w.numpy(), None if imp is None else imp.numpy())
            assert_same_blocks("IQ4_NL", R.quantize_iq4_nl(w, imp).numpy(), theirs, f"{n}x{k} imatrix {imp is not None}")


@pytest.mark.parametrize("kind", ["Q4_1", "Q5_1"])
def test_q1_field_search_is_llama_cpps_imatrix_search(ggml, kind):
    """Q4_1 / Q5_1 with an importance matrix: quantkit's fields (gguf.grids' choose_fields with search, the
    make_qkx3_quants port) against the d and m of the blocks ggml wrote. The row's sigma^2 is not summed in
    the C's order, so a rare block may take another candidate: nearly all blocks must be identical, and the
    rest close."""
    from quantkit.gguf.grids import Q41Weight, Q51Weight

    grid = {"Q4_1": Q41Weight, "Q5_1": Q51Weight}[kind]
    unpack = {"Q4_1": gguf_blocks.unpack_q4_1, "Q5_1": gguf_blocks.unpack_q5_1}[kind]
    g = torch.Generator().manual_seed(7)
    same = total = 0
    for dist in DISTRIBUTIONS:
        w = sample(dist, 24, 512, g)
        imp = sample_importance(512, g)
        _, their_d, their_m = unpack(torch.from_numpy(ggml(kind, w.numpy(), imp.numpy())))  # fp16 [N, K/32]
        d, m = grid.choose_fields(w, search=True, importance=imp)
        hit = (d == their_d) & (m == their_m)
        same += int(hit.sum())
        total += hit.numel()
        span = (w.reshape(24, 16, 32).amax(-1) - w.reshape(24, 16, 32).amin(-1)).float()
        assert ((d.float() - their_d.float()).abs() <= 0.1 * span + 1e-6).all(), dist
        minmax = grid.choose_fields(w)
        assert not torch.equal(minmax[0], d), "the search chose the min-max fields everywhere"
    assert same >= 0.98 * total, f"{kind}: {same}/{total} blocks with ggml's fields"


def fixture_inputs() -> tuple[np.ndarray, np.ndarray]:
    """The fixture's w float32 [8, 512] (two rows of each distribution, the first row zero in part) and
    importance [512]."""
    g = torch.Generator().manual_seed(2026)
    w = torch.cat([sample(dist, 2, 512, g) for dist in DISTRIBUTIONS])
    w[0, :256] = 0.0  # an all-zero super-block
    return w.numpy(), sample_importance(512, g).numpy()


def write_fixture(path: Path = FIXTURE) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        quantize = ggml_quantizer(Path(tmp))
        if isinstance(quantize, str):
            raise SystemExit(quantize)
        w, imp = fixture_inputs()
        arrays = {"w": w, "importance": imp}
        for kind in KINDS + IQ4_KINDS:
            arrays[kind] = quantize(kind, w)
            arrays[kind + "_imatrix"] = quantize(kind, w, imp)
    src = Path(os.environ.get("QUANTKIT_LLAMA_CPP_SRC", "/work/llama/src")) / "ggml" / "src" / "ggml-quants.c"
    digest = hashlib.sha256(src.read_bytes()).hexdigest() if src.is_file() else "unknown"
    folder = Path(os.environ["QUANTKIT_LLAMA_CPP_BIN"])
    lib = next(p for p in (folder / "libggml-base.so", folder / "libggml-base.a") if p.exists())
    arrays["source"] = np.array(f"ggml_quantize_chunk of {lib.resolve().name} ({platform.machine()}); "
                                f"ggml-quants.c sha256 {digest}")
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **arrays)
    print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    write_fixture()


@pytest.mark.parametrize("scale", [1e-3, 1.0, 100.0, 60000.0])
def test_q8_0_equals_the_gguf_package(scale):
    """quantize_q8_0 (what the writer's q8_0 float tensors get) is gguf.quants.quantize's Q8_0, byte for byte:
    d = amax / 127 rounded to fp16 after the codes are rounded (roundf, halves away from zero) against it
    unrounded; a zero block, exact halves and fp16 overflow included."""
    gguf = pytest.importorskip("gguf")
    g = torch.Generator().manual_seed(int(scale * 1000) % 9973)
    for shape in ((7, 64), (3, 4096)):
        w = torch.randn(*shape, generator=g) * scale
        w[0, :32] = 0
        w[-1, 32:64] = torch.arange(32) - 15.5
        theirs = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0)
        assert np.array_equal(R.quantize_q8_0(w).numpy(), theirs)
    assert R.quantize_q8_0(torch.zeros(0, 64)).shape == (0, 68)
