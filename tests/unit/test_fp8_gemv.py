"""`fp8_gemv` (issue #39): the weight-only fp8 Triton kernel for decode rows, and the choice between it and
``torch._scaled_mm``, run on CPU tensors under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET
on a CPU). On a GPU the GPU check runs the engine's fp8 tests (test_quantized_checkpoints.py) and times the
kernel (benchmarks/quantized_kernels.py)."""

from __future__ import annotations

import functools
import logging
import os

import pytest
import torch

from helpers.fp8_weights import fp8_weight, fresh_choices  # noqa: F401 - an autouse fixture
from lmiserve.engine import fp8_devices
from lmiserve.engine.model import fp8_gemv
from lmiserve.engine.model.fp8_ops import fp8_linear, scaled_product

FP8 = torch.float8_e4m3fn  # the weights' dtype in a choice's key (8-bit integer codes share the kernel)

pytestmark = pytest.mark.skipif(
    not fp8_gemv.available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py on CPU)",
)


@pytest.mark.parametrize(
    "config",
    [
        fp8_gemv.Config(False, 1, 16, 32),  # one row a tile: products and sums
        fp8_gemv.Config(False, 4, 32, 64),
        fp8_gemv.Config(True, 16, 16, 32),  # tensor-core tiles
        fp8_gemv.Config(False, 1, 16, 32, split_k=3),  # K split between programs: 3 of 32, or 2 of 64 (100)
        fp8_gemv.Config(True, 16, 16, 32, split_k=2),
        fp8_gemv.Config(False, 1, 16, 32, split_k=3, adds_in_kernel=True),  # the last program adds the splits
        fp8_gemv.Config(True, 16, 16, 32, split_k=2, adds_in_kernel=True),
        fp8_gemv.Config(False, 1, 16, 32, late_sum=True),  # products kept per input, summed once at the end
        fp8_gemv.Config(False, 4, 16, 32, split_k=3, adds_in_kernel=True, late_sum=True),
        fp8_gemv.Config(False, 1, 16, 32, prefetch=True),  # each step's loads issued a step ahead
        fp8_gemv.Config(False, 4, 16, 32, split_k=3, adds_in_kernel=True, prefetch=True, late_sum=True),
    ],
    ids=str,
)
@pytest.mark.parametrize("inputs", [96, 100], ids=["k-even", "k-ragged"])
@pytest.mark.parametrize("rows", [1, 3, 16, 21])
def test_the_kernel_computes_the_dequantized_product(config: fp8_gemv.Config, inputs: int, rows: int) -> None:
    """Outputs not a multiple of the tile (40), inputs a multiple of it or not, rows in one tile or several:
    fp32 activations give fp32's product of the de-quantized weight."""
    weight, scale, dense = fp8_weight(40, inputs)
    x = torch.randn(rows, inputs)
    got = fp8_gemv.fp8_gemv(x, weight, scale, config)
    assert got.dtype == torch.float32 and got.shape == (rows, 40)
    torch.testing.assert_close(got, x @ dense.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_activations_come_back_in_their_dtype_within_its_rounding(dtype: torch.dtype) -> None:
    """A bf16 or fp16 model's rows (the GPU's case) on the per-row tiles; the tensor-core tile in fp16 (the
    interpreter's dot has no bf16: the self-check of `choose` is what catches such a kernel)."""
    weight, scale, dense = fp8_weight(48, 64, seed=1)
    x = torch.randn(2, 64).to(dtype)
    configs = [fp8_gemv.Config(False, 4, 16, 32)] + (
        [fp8_gemv.Config(True, 16, 16, 32)] if dtype == torch.float16 else []
    )
    want = x.float() @ dense.t()
    for config in configs:
        got = fp8_gemv.fp8_gemv(x, weight, scale, config)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.parametrize("in_kernel", [False, True], ids=["added-after", "added-in-kernel"])
@pytest.mark.parametrize("widen", [False, True], ids=["fp8-type", "widened"])
def test_a_split_tile_adds_its_parts_in_one_order_every_run(
    monkeypatch: pytest.MonkeyPatch, widen: bool, in_kernel: bool
) -> None:
    """A split's parts are added in split order, after the kernel or by each output tile's last program, never
    by atomics on the outputs: the same bits on every run (greedy streams stay reproducible), and each split's
    share computed once (a share counted twice or left out is far off); where the bytes are widened too (an
    A100's path: each part scaled by 2**8 over). In the kernel, each tile's counter is back at 0 after every
    product (else the next product's last program would never see its ticket: outputs left unwritten)."""
    from lmiserve.engine.model import kernel_choice

    monkeypatch.setattr(kernel_choice, "_tile_counters", {})  # (another test's weight may have had this address)
    weight, scale, dense = fp8_weight(40, 256, seed=4)
    x = torch.randn(2, 256).to(torch.float16)
    config = fp8_gemv.Config(False, 4, 16, 32, split_k=4, adds_in_kernel=in_kernel)
    first = fp8_gemv.fp8_gemv(x, weight, scale, config, widen=widen)
    assert first.dtype == torch.float16
    for _ in range(2):
        assert torch.equal(first, fp8_gemv.fp8_gemv(x, weight, scale, config, widen=widen))
    want = x.float() @ dense.t()
    torch.testing.assert_close(first.float(), want, rtol=2e-3, atol=2e-3 * want.abs().max().item())
    counters = kernel_choice._tile_counters.get((weight.device, weight.data_ptr()))
    assert (counters is not None) == in_kernel
    if in_kernel:
        assert counters.numel() >= 3 and not counters.any()  # 3 output tiles of 16 (40 outputs), all back at 0
    added_after = fp8_gemv.Config(False, 4, 16, 32, split_k=4)
    assert torch.equal(first, fp8_gemv.fp8_gemv(x, weight, scale, added_after, widen=widen))


def test_a_non_contiguous_row_view_reads_the_right_rows() -> None:
    """The fused projections hand slices of wider activations."""
    weight, scale, dense = fp8_weight(32, 64, seed=2)
    wide = torch.randn(3, 128)
    x = wide[:, 32:96]
    got = fp8_gemv.fp8_gemv(x, weight, scale, fp8_gemv.Config(False, 1, 16, 32))
    torch.testing.assert_close(got, x @ dense.t(), rtol=1e-5, atol=1e-5)


def test_choose_measures_once_per_shape_and_bucket_and_fp8_linear_runs_its_choice(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(fp8_gemv, "INTERPRETED_ON_CPU", True)
    monkeypatch.setattr(fp8_gemv, "CANDIDATES", {b: configs[:2] for b, configs in fp8_gemv.CANDIDATES.items()})
    weight, scale, dense = fp8_weight(48, 64, seed=3)
    calls: list[int] = []

    def product(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return scaled_product(x, weight, scale)

    caplog.set_level(logging.INFO, logger=fp8_gemv.__name__)
    x = torch.randn(3, 64)
    first = fp8_gemv.choose(x, weight, scale, product)
    assert calls, "the _scaled_mm product was timed against the kernel"
    assert "fp8 products [48 x 64] at 4 row(s)" in caplog.text
    measured = len(calls)
    assert fp8_gemv.choose(torch.randn(2, 64), weight, scale, product) == first  # 2-4 rows: the same bucket
    assert len(calls) == measured
    fp8_gemv.choose(torch.randn(1, 64), weight, scale, product)  # another bucket: measured
    assert len(calls) > measured
    assert set(fp8_gemv.chosen()) == {
        (torch.device("cpu"), 48, 64, 4, torch.float32, 0, False, FP8, False),
        (torch.device("cpu"), 48, 64, 1, torch.float32, 0, False, FP8, False),
    }
    # fp8_linear takes the choice: the kernel (fp32 exact) or the _scaled_mm product (fp8 activations)
    fp8_gemv._chosen[(torch.device("cpu"), 48, 64, 4, torch.float32, 0, False, FP8, False)] = fp8_gemv.Config(
        False, 4, 16, 32
    )
    torch.testing.assert_close(fp8_linear(x, weight, scale), x @ dense.t(), rtol=1e-5, atol=1e-5)
    fp8_gemv._chosen[(torch.device("cpu"), 48, 64, 4, torch.float32, 0, False, FP8, False)] = None
    torch.testing.assert_close(fp8_linear(x, weight, scale), scaled_product(x, weight, scale))


def test_more_rows_than_max_rows_and_cpu_tensors_never_take_the_kernel() -> None:
    weight, scale, _ = fp8_weight(32, 64)
    never = functools.partial(pytest.fail, "not measured")
    assert fp8_gemv.choose(torch.randn(17, 64), weight, scale, never) is None  # INTERPRETED_ON_CPU or not
    assert fp8_gemv.choose(torch.randn(1, 64), weight, scale, never) is None  # a CPU tensor, not interpreted
    assert fp8_gemv.chosen() == {}


def test_a_kernel_that_computes_wrong_is_refused_and_scaled_mm_serves(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The self-check: however fast, a tile whose product is off (a GPU or Triton miscompiling it) is never
    chosen, and the refusal is logged. Here every tile disagrees with the check's de-quantized product by 2x
    (as a kernel that lost a scale would)."""
    reference = fp8_gemv._reference
    monkeypatch.setattr(fp8_gemv, "INTERPRETED_ON_CPU", True)
    monkeypatch.setattr(fp8_gemv, "_reference", lambda *args: 2 * reference(*args))
    weight, scale, _ = fp8_weight(32, 64, seed=4)
    x = torch.randn(1, 64)
    assert fp8_gemv.choose(x, weight, scale, lambda x: scaled_product(x, weight, scale)) is None
    assert "fp8 candidates refused for [32 x 64] at 1 rows" in caplog.text and "off by" in caplog.text


def test_a_measurement_that_fails_leaves_scaled_mm_serving_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Measuring needs memory for its probe and reference: a failure there (a full GPU) never fails the step."""

    def out_of_memory(*_: object) -> torch.Tensor:
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(fp8_gemv, "INTERPRETED_ON_CPU", True)
    monkeypatch.setattr(fp8_gemv, "_reference", out_of_memory)
    weight, scale, _ = fp8_weight(32, 64, seed=5)
    x = torch.randn(1, 64)
    torch.testing.assert_close(fp8_linear(x, weight, scale), scaled_product(x, weight, scale))
    assert "measuring the fp8 Triton kernel for [32 x 64] failed (CUDA out of memory)" in caplog.text
    assert list(fp8_gemv.chosen().values()) == [None]  # not measured again at every product


@pytest.fixture
def without_fp8_products(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU tensors read as a GPU without fp8 products reads them (an A100 or A10G: `fp8_devices.native` false)."""
    monkeypatch.setattr(fp8_devices, "native", lambda device: False)


def every_fp8_byte(out: int) -> torch.Tensor:
    """`out` rows of every e4m3fn byte but the two NaNs (0x7f, 0xff: zeros there), each row in its own order."""
    bits = torch.arange(256, dtype=torch.uint8)
    bits[bits == 0x7F] = 0
    bits[bits == 0xFF] = 0
    generator = torch.Generator().manual_seed(0)
    rows = [bits[torch.randperm(256, generator=generator)] for _ in range(out)]
    return torch.stack(rows).view(torch.float8_e4m3fn)


@pytest.mark.usefixtures("without_fp8_products")
@pytest.mark.parametrize("config", [fp8_gemv.Config(False, 1, 16, 64), fp8_gemv.Config(True, 16, 16, 64)], ids=str)
def test_the_bytes_widened_without_fp8_products_are_every_fp8_value_exactly(config: fp8_gemv.Config) -> None:
    """Sign, exponent and mantissa moved into a fp16 and scaled by 2**8: every value, the subnormals (2**-9 to
    7 * 2**-9) and 448 included, comes back exact. The rows of the identity read each column of the weight."""
    weight = every_fp8_byte(24)
    scale = torch.ones(24)
    want = weight.float()
    rows = 1 if not config.use_dot else 256
    for start in range(0, 256, rows):
        x = torch.eye(256)[start : start + rows]
        got = fp8_gemv.fp8_gemv(x, weight, scale, config)
        assert torch.equal(got, want[:, start : start + rows].t()), start
    assert want.abs().max() == 448 and want[want != 0].abs().min() == 2**-9


@pytest.mark.usefixtures("without_fp8_products")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 40, 300])
def test_without_fp8_products_the_kernel_serves_every_row_count(dtype: torch.dtype, rows: int) -> None:
    """Decode rows on the per-row tiles, and the rows of a prompt (prefill) on tensor-core tiles, per-channel
    scales applied: fp32 activations give fp32's product of the de-quantized weight, fp16 ones its rounding."""
    weight, scale, dense = fp8_weight(40, 100, seed=6)
    x = torch.randn(rows, 100).to(dtype)
    config = fp8_gemv.Config(False, 1, 16, 32) if rows == 1 else fp8_gemv.Config(True, 16, 16, 32)
    got = fp8_gemv.fp8_gemv(x, weight, scale, config)
    want = x.float() @ dense.t()
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.usefixtures("without_fp8_products")
def test_without_fp8_products_choose_measures_prompt_buckets_against_the_dequantized_product(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No ``_scaled_mm`` there: more than `MAX_ROWS` rows are measured too (buckets 64, 256, 1024), against the
    weight de-quantized a slice at a time, which serves where no tile does (refused here: a tile off by 2x)."""
    monkeypatch.setattr(fp8_gemv, "INTERPRETED_ON_CPU", True)
    monkeypatch.setattr(fp8_gemv, "CANDIDATES", {b: configs[:1] for b, configs in fp8_gemv.CANDIDATES.items()})
    monkeypatch.setattr(fp8_gemv, "SLICE", 16)  # several slices
    weight, scale, dense = fp8_weight(40, 64, seed=7)
    caplog.set_level(logging.INFO, logger=fp8_gemv.__name__)
    for rows, size in ((17, 64), (65, 256), (257, 1024)):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(fp8_linear(x, weight, scale), x @ dense.t(), rtol=1e-5, atol=1e-5)
        assert (torch.device("cpu"), 40, 64, size, torch.float32, 0, False, FP8, False) in fp8_gemv.chosen()
        assert f"fp8 products [40 x 64] at {size} row(s)" in caplog.text
    assert "torch._scaled_mm" not in caplog.text
    reference = fp8_gemv._reference
    monkeypatch.setattr(fp8_gemv, "_chosen", {})
    monkeypatch.setattr(fp8_gemv, "_reference", lambda *args: 2 * reference(*args))
    x = torch.randn(20, 64)
    torch.testing.assert_close(fp8_linear(x, weight, scale), x @ dense.t(), rtol=1e-5, atol=1e-5)
    assert fp8_gemv.chosen() == {(torch.device("cpu"), 40, 64, 64, torch.float32, 0, False, FP8, False): None}
    assert "fp8 candidates refused for [40 x 64] at 64 rows" in caplog.text


def test_on_a_gpu_with_fp8_products_more_rows_than_max_rows_stay_on_scaled_mm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp8_gemv, "INTERPRETED_ON_CPU", True)
    weight, scale, _ = fp8_weight(32, 64)
    assert fp8_gemv.choose(torch.randn(17, 64), weight, scale, functools.partial(pytest.fail, "measured")) is None


def test_the_choice_times_each_product_on_the_gpus_own_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA every candidate and the product it would replace are timed replayed in a CUDA graph where decode
    rows run them (eagerly, a few rows' product times its launches, the same for every tile), eagerly where a
    prompt's rows do; the fastest by those times is kept."""
    from lmiserve.engine.model import kernel_choice

    graphed: list[object] = []
    monkeypatch.setattr(kernel_choice, "time_in_graph", lambda call, device: graphed.append(call) or 1.0)
    assert kernel_choice.time_gpu(lambda: None, torch.device("cuda")) == 1.0 and len(graphed) == 1
    assert kernel_choice.time_gpu(lambda: torch.ones(1), torch.device("cpu")) < 1.0  # no graphs: timed as it runs

    weight, scale, dense = fp8_weight(48, 64, seed=5)
    x = torch.randn(1, 64)
    tiles = fp8_gemv.CANDIDATES[1][:3]
    timed: dict[str, float] = {}

    def gpu_time(call: object, device: torch.device) -> float:
        config = getattr(call, "args", ("baseline",))[0]
        timed[str(config)] = {str(tiles[2]): 1e-6}.get(str(config), 1e-3)
        return timed[str(config)]

    def pick(rows: int) -> fp8_gemv.Config | None:
        timed.clear()
        run = lambda config: fp8_gemv.fp8_gemv(x, weight, scale, config)  # noqa: E731
        baseline = ("the baseline", lambda: x @ dense.t())
        log = logging.getLogger("test")
        return kernel_choice.pick(log, "fp8", (48, 64, rows), tiles, run, x @ dense.t(), x.device, baseline)

    monkeypatch.setattr(kernel_choice, "time_gpu", gpu_time)
    monkeypatch.setattr(kernel_choice, "time_call", lambda call, device: pytest.fail("timed eagerly"))
    assert pick(kernel_choice.DECODE_ROWS) == tiles[2] and set(timed) == {"baseline", *map(str, tiles)}
    # a prompt's rows (eager steps): timed as they run, launches included
    monkeypatch.setattr(kernel_choice, "time_call", gpu_time)
    monkeypatch.setattr(kernel_choice, "time_gpu", lambda call, device: pytest.fail("timed in a graph"))
    assert pick(kernel_choice.DECODE_ROWS + 1) == tiles[2] and set(timed) == {"baseline", *map(str, tiles)}
