"""numba_flash.attention: array classification, argument validation, backend choice, dispatch."""
import importlib
import importlib.metadata
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import numba_flash
from numba_flash import api, validation
from numba_flash.arrays import describe, describe_all, dtype_name
from numba_flash_reference.masks import CausalMask, Mask

ROOT = Path(__file__).resolve().parents[1]


class FakeGpuArray:
    """A stand-in for a GPU array: only ``__cuda_array_interface__`` (and optionally dtype/device)."""

    def __init__(self, shape, typestr="<f4", strides=None, dtype=None, device=None):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr,
                                         "strides": strides, "data": (12345678, False),
                                         "version": 3}
        if dtype is not None:
            self.dtype = dtype
        if device is not None:
            self.device = device

    @property
    def shape(self):
        return self.__cuda_array_interface__["shape"]


class FakeTorchDtype:
    def __str__(self):
        return "torch.bfloat16"


def rand(shape, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def qkv(b=2, sq=5, sk=7, hq=4, hkv=2, d=8, dtype=np.float32):
    return (rand((b, sq, hq, d), dtype, 1), rand((b, sk, hkv, d), dtype, 2),
            rand((b, sk, hkv, d), dtype, 3))


def gpu_qkv(b=2, sq=5, sk=7, hq=4, hkv=2, d=8, typestr="<f2"):
    return (FakeGpuArray((b, sq, hq, d), typestr), FakeGpuArray((b, sk, hkv, d), typestr),
            FakeGpuArray((b, sk, hkv, d), typestr))


class SizedMask(Mask):
    """Every other key visible; valid only for seqlen_k == n (exercises _check_sizes)."""

    def __init__(self, n):
        self.n = n

    def _check_sizes(self, seqlen_q, seqlen_k):
        if seqlen_k != self.n:
            raise ValueError(f"SizedMask was built for seqlen_k={self.n}, got {seqlen_k}")

    def _visible(self, qpos, kpos, seqlen_k):
        return np.broadcast_to(kpos % 2 == 0, np.broadcast_shapes(qpos.shape, kpos.shape))

    def __repr__(self):
        return f"sized({self.n})"


# ---------------------------------------------------------------- classification (arrays.py)

def test_numpy_arrays_are_numpy_kind():
    x = rand((3, 5, 2, 4), np.float16)[:, ::2]
    info = describe(x, "q")
    assert (info.kind, info.shape, info.dtype, info.device) == ("numpy", (3, 3, 2, 4),
                                                                np.dtype(np.float16), None)
    assert info.strides == x.strides


def test_gpu_interface_objects_are_cuda_kind_with_c_strides_filled_in():
    info = describe(FakeGpuArray((2, 3, 5, 7), "<f2"), "k")
    assert info.kind == "cuda"
    assert info.shape == (2, 3, 5, 7)
    assert info.dtype == np.dtype(np.float16)
    assert info.strides == (3 * 5 * 7 * 2, 5 * 7 * 2, 7 * 2, 2)


def test_gpu_interface_strides_and_device_are_read():
    dev = types.SimpleNamespace(id=3)  # CuPy's Device has .id
    info = describe(FakeGpuArray((2, 3), "<f8", strides=(8, 16), device=dev), "q")
    assert info.strides == (8, 16) and info.dtype == np.float64 and info.device == 3
    torch_dev = types.SimpleNamespace(index=1)  # torch.device has .index
    assert describe(FakeGpuArray((2,), "<f4", device=torch_dev), "q").device == 1


@pytest.mark.parametrize("obj", [
    FakeGpuArray((4,), "<f2", dtype=FakeTorchDtype()),          # torch reports bf16 as "<f2"
    FakeGpuArray((4,), "<V2"),                                   # ml_dtypes / JAX spelling
    FakeGpuArray((4,), "<u2", dtype=np.dtype(ml_dtypes.bfloat16)),
])
def test_bfloat16_is_recognised_on_gpu_arrays(obj):
    assert describe(obj, "q").dtype == np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("dtype", [np.float16, "float32", np.dtype("<f8"), np.dtype(">f4"),
                                   np.dtype(ml_dtypes.bfloat16), np.int32, "V2"])
def test_dtype_name_is_numpys_name(dtype):
    """The cached name equals NumPy's, on the first call and on a cached one."""
    assert dtype_name(dtype) == np.dtype(dtype).name
    assert dtype_name(dtype) == np.dtype(dtype).name


@pytest.mark.parametrize("obj, hint", [
    ([[1.0, 2.0]], "np.asarray"),
    (3.5, "got float"),
    (types.SimpleNamespace(shape=(1, 2, 3, 4)), "__cuda_array_interface__"),
    (np.ma.masked_array(np.ones(3)), "masked"),
])
def test_unaccepted_objects_raise_type_error_naming_argument(obj, hint):
    with pytest.raises(TypeError, match="^v ") as err:
        describe(obj, "v")
    assert hint in str(err.value)


def test_cpu_tensor_like_without_interface_is_rejected():
    class CpuTensor:  # torch CPU tensors raise AttributeError from the property
        @property
        def __cuda_array_interface__(self):
            raise AttributeError("Can't get __cuda_array_interface__ on non-CUDA tensor")

    with pytest.raises(TypeError, match="k must be a NumPy ndarray"):
        describe(CpuTensor(), "k")


def test_malformed_interface_is_rejected():
    obj = FakeGpuArray((2,))
    obj.__cuda_array_interface__ = {"data": (0, False)}
    with pytest.raises(TypeError, match="q has a malformed __cuda_array_interface__"):
        describe(obj, "q")


def test_masked_gpu_arrays_are_rejected():
    obj = FakeGpuArray((2, 3))
    obj.__cuda_array_interface__["mask"] = FakeGpuArray((2, 3), "|b1")
    with pytest.raises(TypeError, match="q is a masked GPU array"):
        describe(obj, "q")


def test_mixed_kinds_raise_type_error_naming_both():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="q and k must be arrays of the same kind"):
        describe_all(q=q, k=FakeGpuArray(k.shape), v=v)
    with pytest.raises(TypeError, match="q and v must be arrays of the same kind"):
        numba_flash.attention(q, k, FakeGpuArray(v.shape))
    with pytest.raises(TypeError, match="q and k"):
        numba_flash.attention(FakeGpuArray(q.shape), k, v)


def test_gpu_arrays_on_different_devices_raise():
    a = FakeGpuArray((1, 2, 2, 4), device=types.SimpleNamespace(id=0))
    b = FakeGpuArray((1, 2, 2, 4), device=types.SimpleNamespace(id=1))
    with pytest.raises(ValueError, match="q and k must be on the same GPU"):
        describe_all(q=a, k=b, v=b)


# ---------------------------------------------------------------- validation

@pytest.mark.parametrize("shapes, match", [
    (((2, 3, 4), (2, 3, 4, 8), (2, 3, 4, 8)),
     r"q must have 4 dimensions \(batch, seqlen_q, heads_q, head_dim\), got shape \(2, 3, 4\)"),
    (((2, 3, 4, 8), (2, 3, 4, 8, 1), (2, 3, 4, 8)), r"k must have 4 dimensions \(batch, seqlen_k"),
    (((2, 3, 4, 8), (2, 3, 4, 8), (3, 4, 8)), r"v must have 4 dimensions"),
    (((2, 3, 4, 8), (2, 5, 4, 8), (2, 6, 4, 8)), r"k and v must have the same \(batch, seqlen_k, heads_kv\)"),
    (((2, 3, 4, 8), (3, 5, 4, 8), (3, 5, 4, 8)), r"q and k must have the same batch size"),
    (((2, 3, 4, 8), (2, 5, 4, 6), (2, 5, 4, 6)), r"q and k must have the same head_dim"),
    (((2, 3, 6, 8), (2, 5, 4, 8), (2, 5, 4, 8)), r"heads_q must be a multiple of heads_kv"),
    (((2, 0, 4, 8), (2, 5, 4, 8), (2, 5, 4, 8)), r"q must have seqlen_q >= 1"),
    (((2, 3, 4, 8), (2, 0, 4, 8), (2, 0, 4, 8)), r"k must have seqlen_k >= 1"),
    (((0, 3, 4, 8), (0, 5, 4, 8), (0, 5, 4, 8)), r"q must have batch >= 1"),
    (((2, 3, 4, 0), (2, 5, 4, 0), (2, 5, 4, 0)), r"q must have head_dim >= 1"),
])
def test_shape_errors(shapes, match):
    arrays = [rand(s, seed=i) for i, s in enumerate(shapes)]
    with pytest.raises(ValueError, match=match):
        numba_flash.attention(*arrays)


def test_shape_errors_apply_to_gpu_arrays_too():
    with pytest.raises(ValueError, match="heads_q must be a multiple of heads_kv"):
        numba_flash.attention(*gpu_qkv(hq=5, hkv=2))


def test_dtype_errors():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="q, k and v must have the same dtype, got q float32, "
                                        "k float64, v float32"):
        numba_flash.attention(q, k.astype(np.float64), v)
    with pytest.raises(TypeError, match="dtype int32; expected one of float16, bfloat16"):
        numba_flash.attention(*(x.astype(np.int32) for x in (q, k, v)))
    with pytest.raises(TypeError, match="dtype complex64"):
        numba_flash.attention(*(x.astype(np.complex64) for x in (q, k, v)))
    with pytest.raises(TypeError, match="dtype int8"):
        numba_flash.attention(*gpu_qkv(typestr="|i1"))


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(softmax_scale="0.5"), TypeError, r"softmax_scale must be a real number or None, got str"),
    (dict(softmax_scale=True), TypeError, r"softmax_scale must be a real number or None"),
    (dict(softmax_scale=float("nan")), ValueError, r"softmax_scale must be finite and non-zero"),
    (dict(softmax_scale=math.inf), ValueError, r"softmax_scale must be finite"),
    (dict(softmax_scale=0.0), ValueError, r"softmax_scale must be finite and non-zero"),
    (dict(softcap=-1.0), ValueError, r"softcap must be a finite number > 0 \(or None / 0.0 for no "
                                     r"softcap\), got -1.0"),
    (dict(softcap=math.inf), ValueError, r"softcap must be"),
    (dict(softcap="big"), TypeError, r"softcap must be a positive real number or None, got str"),
    (dict(causal=1), TypeError, r"causal must be a bool \(True or False\), got int 1"),
    (dict(causal="yes"), TypeError, r"causal must be a bool"),
    (dict(return_lse=None), TypeError, r"return_lse must be a bool"),
    (dict(window_size=(3,)), TypeError, r"window_size must be a pair"),
    (dict(window_size=4), TypeError, r"window_size must be a pair"),
    (dict(window_size=(1.5, 2)), TypeError, r"window_size must hold two integers"),
    (dict(window_size=(-2, 0)), ValueError, r"window_size entries must be >= -1"),
    (dict(sinks=-1), ValueError, r"sinks must be >= 0, got -1"),
    (dict(sinks=2.0), TypeError, r"sinks must be an integer >= 0, got float"),
    (dict(sinks=True), TypeError, r"sinks must be an integer"),
    (dict(mask=np.ones((5, 7), bool)), TypeError, r"mask must be None or a mask object from "
                                                  r"numba_flash.masks.*got ndarray"),
    (dict(mask="causal"), TypeError, r"mask must be None or a mask object"),
    (dict(backend="gpu"), ValueError, r"backend must be one of 'auto', 'cpu', 'cuda', got 'gpu'"),
    (dict(backend=None), ValueError, r"backend must be one of"),
    (dict(stream=7), ValueError, r"stream applies to the CUDA backend only.*got 7"),
])
def test_option_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        numba_flash.attention(*qkv(), **kwargs)


def test_mask_size_errors_come_from_the_mask():
    q, k, v = qkv(sk=7)
    with pytest.raises(ValueError, match="SizedMask was built for seqlen_k=9, got 7"):
        numba_flash.attention(q, k, v, mask=SizedMask(9))
    # Also when the mask is combined with the causal flag, and for GPU arrays before dispatch.
    with pytest.raises(ValueError, match="SizedMask was built for seqlen_k=9"):
        numba_flash.attention(q, k, v, mask=SizedMask(9), causal=True)
    with pytest.raises(ValueError, match="SizedMask was built for seqlen_k=9"):
        numba_flash.attention(*gpu_qkv(sk=7), mask=SizedMask(9))


def test_mask_size_errors_of_library_masks():
    masks = pytest.importorskip("numba_flash.masks")
    q, k, v = qkv(sq=9, sk=9)
    with pytest.raises(ValueError):
        numba_flash.attention(q, k, v, mask=masks.causal_document([4, 4]))


def test_gpu_arrays_need_a_contiguous_head_dim():
    q, k, v = gpu_qkv(d=8)
    q.__cuda_array_interface__["strides"] = (2 * 5 * 4 * 16, 4 * 16, 16, 4)
    with pytest.raises(ValueError, match=r"q must have a contiguous head_dim \(last axis stride 2 "
                                         r"bytes\)"):
        numba_flash.attention(q, k, v)
    k.__cuda_array_interface__["strides"] = (2 * 7 * 2 * 8 + 1, 2 * 8, 8, 2)
    q2 = gpu_qkv(d=8)[0]
    with pytest.raises(ValueError, match="k strides must be multiples of the itemsize 2"):
        numba_flash.attention(q2, k, v)


def test_validate_normalises_options():
    q, k, v = qkv(b=1, sq=3, sk=11, hq=6, hkv=3, d=16)
    p = validation.validate(q, k, v, window_size=[4, np.int64(0)], sinks=np.int32(2),
                            causal=np.bool_(True), softcap=np.float32(30), return_lse=np.bool_(1))
    assert (p.kind, p.backend, p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv,
            p.head_dim) == ("numpy", "cpu", 1, 3, 11, 6, 3, 16)
    assert p.window_size == (4, 0) and type(p.window_size[1]) is int
    assert p.sinks == 2 and type(p.sinks) is int
    assert p.causal is True and p.return_lse is True
    assert p.softcap == 30.0 and type(p.softcap) is float
    assert p.softmax_scale == pytest.approx(0.25)
    assert validation.validate(q, k, v, softcap=0.0).softcap is None  # flash-attn's "off"
    assert validation.validate(q, k, v, softmax_scale=np.float16(0.5)).softmax_scale == 0.5


# ---------------------------------------------------------------- backends and dispatch

def test_cpu_backend_rejects_gpu_arrays():
    with pytest.raises(ValueError, match=r"backend='cpu' runs on NumPy arrays, got GPU arrays"):
        numba_flash.attention(*gpu_qkv(), backend="cpu")


def test_cuda_backend_rejects_numpy_arrays_without_the_simulator(monkeypatch):
    monkeypatch.setattr(validation, "cuda_simulator_enabled", lambda: False)
    with pytest.raises(ValueError, match=r"backend='cuda' needs GPU arrays.*NUMBA_ENABLE_CUDASIM"):
        numba_flash.attention(*qkv(), backend="cuda")


def test_simulator_flag_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    assert validation.cuda_simulator_enabled() is True
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "0")
    monkeypatch.delitem(sys.modules, "numba.core.config", raising=False)
    assert validation.cuda_simulator_enabled() is False


class Recorder:
    def __init__(self, result="sentinel"):
        self.calls = []
        self.result = result

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.result


def test_gpu_arrays_are_dispatched_with_normalised_arguments(monkeypatch):
    fake = Recorder()
    monkeypatch.setattr(api, "_load_attention_cuda", lambda: fake)
    q, k, v = gpu_qkv(hq=6, hkv=3, d=16)
    mask = CausalMask()
    stream = object()
    result = numba_flash.attention(q, k, v, window_size=[5, -1], sinks=np.int64(1), mask=mask,
                                   softcap=np.float64(20), return_lse=True, stream=stream)
    assert result == "sentinel"
    (args, kwargs), = fake.calls
    assert args[0] is q and args[1] is k and args[2] is v
    # masks.causal() reaches the kernels as the causal flag (validation.lower_window_mask)
    assert kwargs == dict(softmax_scale=0.25, causal=True, window_size=(5, -1), sinks=1,
                          mask=None, softcap=20.0, return_lse=True, stream=stream, fast=None)
    assert type(kwargs["softmax_scale"]) is float and type(kwargs["window_size"]) is tuple
    document = numba_flash.masks.causal_document([3, 4])
    numba_flash.attention(q, k, v, mask=document)
    assert fake.calls[-1][1]["mask"] is document and fake.calls[-1][1]["causal"] is False


def test_explicit_cuda_backend_dispatches_gpu_arrays(monkeypatch):
    fake = Recorder()
    monkeypatch.setattr(api, "_load_attention_cuda", lambda: fake)
    numba_flash.attention(*gpu_qkv(), backend="cuda", causal=True, softmax_scale=3)
    (_, kwargs), = fake.calls
    assert kwargs["causal"] is True and kwargs["softmax_scale"] == 3.0
    assert kwargs["stream"] is None and kwargs["softcap"] is None and kwargs["mask"] is None


def test_numpy_arrays_reach_the_kernels_under_the_simulator(monkeypatch):
    fake = Recorder()
    monkeypatch.setattr(api, "_load_attention_cuda", lambda: fake)
    monkeypatch.setattr(validation, "cuda_simulator_enabled", lambda: True)
    q, k, v = qkv()
    numba_flash.attention(q, k, v, backend="cuda")
    (args, _), = fake.calls
    assert args[0] is q
    # "auto" keeps NumPy inputs in CPU mode even under the simulator.
    out = numba_flash.attention(q, k, v)
    assert isinstance(out, np.ndarray) and len(fake.calls) == 1


def test_missing_cuda_backend_raises_not_implemented(monkeypatch):
    def no_module(name, package=None):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(api.importlib, "import_module", no_module)
    with pytest.raises(NotImplementedError, match="the CUDA backend is not available yet"):
        numba_flash.attention(*gpu_qkv())


def test_launch_module_without_entry_point_raises_not_implemented(monkeypatch):
    monkeypatch.setattr(api.importlib, "import_module", lambda name: types.ModuleType(name))
    with pytest.raises(NotImplementedError, match="the CUDA backend is not available yet"):
        api._load_attention_cuda()


def test_launch_module_entry_point_is_returned(monkeypatch):
    module = types.ModuleType("numba_flash.cuda.launch.attention")
    module.attention_cuda = Recorder()
    seen = []
    monkeypatch.setattr(api.importlib, "import_module",
                        lambda name: seen.append(name) or module)
    assert api._load_attention_cuda() is module.attention_cuda
    assert seen == ["numba_flash.cuda.launch.attention"]


def test_other_import_errors_of_the_backend_propagate(monkeypatch):
    def broken(name, package=None):
        raise ModuleNotFoundError("No module named 'cupy'", name="cupy")

    monkeypatch.setattr(api.importlib, "import_module", broken)
    with pytest.raises(ModuleNotFoundError, match="cupy"):
        api._load_attention_cuda()


def test_validation_happens_before_dispatch(monkeypatch):
    fake = Recorder()
    monkeypatch.setattr(api, "_load_attention_cuda", lambda: fake)
    with pytest.raises(ValueError, match="window_size"):
        numba_flash.attention(*gpu_qkv(), window_size=(-3, 1))
    assert fake.calls == []


# ---------------------------------------------------------------- package surface

def test_public_api_and_version():
    assert numba_flash.__all__ == ["attention", "attention_backward", "decode", "merge_states",
                                   "warmup", "masks", "__version__"]
    assert numba_flash.attention is api.attention
    assert numba_flash.__version__ == importlib.metadata.version("numba-flash")
    assert "lse" in numba_flash.attention.__doc__ and "(batch, heads_q, seqlen_q)" in \
        numba_flash.attention.__doc__
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        numba_flash.nonexistent


def test_masks_attribute_loads_the_masks_module():
    if importlib.util.find_spec("numba_flash.masks") is None:
        pytest.skip("numba_flash.masks is not written yet")
    assert numba_flash.masks is importlib.import_module("numba_flash.masks")
    assert "masks" in dir(numba_flash) and "attention" in dir(numba_flash)


def test_import_is_light():
    code = ("import sys, numba_flash; "
            "heavy = [m for m in ('numba', 'numba.cuda', 'cupy', 'torch') if m in sys.modules]; "
            "print(heavy)")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.skipif(not validation.cuda_simulator_enabled(), reason="needs Numba's CUDA simulator")
def test_numpy_inputs_through_the_real_kernels_in_the_simulator():
    pytest.importorskip("numba_flash.cuda.launch.attention")
    rng = np.random.default_rng(21)
    q = rng.standard_normal((1, 5, 2, 32)).astype(np.float32)
    k = rng.standard_normal((1, 7, 1, 32)).astype(np.float32)
    v = rng.standard_normal((1, 7, 1, 32)).astype(np.float32)
    out, lse = numba_flash.attention(q, k, v, causal=True, backend="cuda", return_lse=True)
    ref, ref_lse = numba_flash.attention(q, k, v, causal=True, return_lse=True)
    assert out.dtype == np.float32 and out.shape == (1, 5, 2, 32) and lse.shape == (1, 2, 5)
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-6)
    np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=2e-6)


# ----------------------------------------------------------------------------- precision
def test_precision_is_checked():
    with pytest.raises(ValueError, match=r"precision must be one of 'auto', 'ieee', "
                                         r"'tensor_cores', got 'tf32'"):
        numba_flash.attention(*qkv(), precision="tf32")
    with pytest.raises(ValueError, match=r"precision='ieee' applies to float32 / float64 "
                                         r"inputs; float16"):
        numba_flash.attention(*qkv(dtype=np.float16), precision="ieee")


@pytest.mark.parametrize("dtype,d,kw,got", [
    (np.float32, 160, {}, "head_dim 160"),
    (np.float64, 64, dict(alibi_slopes=np.ones(4, np.float32)), "alibi_slopes"),
    (np.float32, 32, dict(mask=CausalMask() & CausalMask()), "a mask object"),
])
def test_tensor_cores_refuse_what_their_kernels_lack(dtype, d, kw, got):
    with pytest.raises(NotImplementedError, match=f"precision='tensor_cores'.*got {got}"):
        numba_flash.attention(*qkv(d=d, dtype=dtype), precision="tensor_cores", **kw)


def test_tensor_cores_take_packed_batches_in_float64_only():
    rng = np.random.default_rng(2)
    cu = np.array([0, 3, 7], np.int32)
    q, k, v = (rng.standard_normal((7, 2, 32)) for _ in range(3))
    want = numba_flash.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    got = numba_flash.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True,
                                precision="tensor_cores")
    assert np.array_equal(got, want)            # CPU mode: float64 whatever the setting
    with pytest.raises(NotImplementedError, match="takes head_dim up to 128 and the flags "
                                                  r"\(causal, window_size, sinks, softcap\) "
                                                  "only, got cu_seqlens"):
        numba_flash.attention(*(x.astype(np.float32) for x in (q, k, v)), cu_seqlens_q=cu,
                              cu_seqlens_k=cu, precision="tensor_cores")


def test_precision_leaves_cpu_mode_exact():
    q, k, v = qkv(dtype=np.float64, d=32)
    expect = numba_flash.attention(q, k, v, causal=True)
    for precision in ("ieee", "tensor_cores"):
        got = numba_flash.attention(q, k, v, causal=True, precision=precision)
        assert np.array_equal(got, expect)
    # 16-bit inputs are on tensor cores anyway
    numba_flash.attention(*qkv(dtype=np.float16), precision="tensor_cores")


@pytest.mark.skipif(not validation.cuda_simulator_enabled(),
                    reason="NumPy arrays reach the kernels only in the simulator")
def test_tensor_cores_reach_the_dmma_kernel():
    """The public door with precision='tensor_cores' runs the DMMA kernel (simulator) and agrees
    with CPU mode to float64 rounding."""
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 9, 1, 32)) for _ in range(3))
    got = numba_flash.attention(q, k, v, causal=True, backend="cuda", precision="tensor_cores")
    np.testing.assert_allclose(got, numba_flash.attention(q, k, v, causal=True), rtol=0,
                               atol=1e-12)
