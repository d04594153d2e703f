"""The benchmark scripts stay runnable: every one imports, and the cross-implementation step and TP
benchmarks still build their pairs (a renamed helper, and later a new attention input the DTensor plan
did not list, once broke them silently, as nothing ran them)."""

import importlib
import re

import pytest

BENCHES = ("agreement", "checkpoint", "concat", "cp", "fp8", "fsdp", "fsdp_runners", "gemm_limit", "pp", "ranks",
           "step", "tp", "prepare_data", "tokenizer_throughput", "trainer_step")


@pytest.mark.parametrize("name", BENCHES)
def test_every_bench_script_imports(name: str) -> None:
    importlib.import_module(f"scripts.bench.{name}")


def test_step_bench_runs_ours_eager_compiled_and_hf_to_the_same_loss_and_its_limit() -> None:
    step = importlib.import_module("scripts.bench.step")
    args = step.model_args("tiny", 32)
    result = step.run(args, batch=2, warmup=1, steps=1, seed=0)
    losses = result["losses"]
    assert abs(losses["ours"] - losses["HF"]) <= 1e-6 * abs(losses["HF"])
    assert abs(losses["ours compile=true"] - losses["ours"]) <= 1e-5 * abs(losses["ours"])
    assert abs(losses[step.FUSED] - losses["ours"]) <= 1e-5 * abs(losses["ours"])
    assert "agree within" in step.require_agreement("losses", abs(losses["ours"] - losses["HF"]) / abs(losses["HF"]),
                                                    rtol=1e-6)
    rows = step.table("tiny", args, 2 * 32, result).splitlines()[2:]
    assert [row.split(" | ")[1] for row in rows] == ["ours", "ours compile=true", step.FUSED, "HF", step.LIMIT]
    assert rows[-1].endswith("| 1.00 |") and result["limit_flops"] > 0


def test_the_limit_counts_every_block_gemm_of_a_step_once() -> None:
    """Forward, input-gradient and weight-gradient products of each block linear: 6 x tokens x weights."""
    from model.args import ModelArgs
    from model.transformer import TransformerBlock
    from parallel.tensor_parallel import TPContext
    from scripts.bench.gemm_limit import block_gemm_shapes

    args = ModelArgs(dim=64, n_heads=4, n_kv_heads=2, multiple_of=32)
    linear_weights = sum(p.numel() for name, p in TransformerBlock(0, args, TPContext()).named_parameters()
                         if "norm" not in name)
    assert sum(2 * m * k * n for m, k, n in block_gemm_shapes(args, 48)) == 6 * 48 * linear_weights


def test_tp_bench_runs_ours_and_dtensor_against_tp1_on_two_ranks(capsys) -> None:
    tp = importlib.import_module("scripts.bench.tp")
    tp.main(["--quick", "--model", "tiny", "--tp", "2", "--seq", "32", "--batch", "1"])
    out = capsys.readouterr().out
    against_tp1 = out.split("against the TP=1 block")[1]
    # | tp | SP | output ours | output DTensor | input grad ours | input grad DTensor |, with and without SP
    rows = [line.split("|")[3:7] for line in against_tp1.splitlines() if re.match(r"\| 2 \| (True|False) \|", line)]
    assert len(rows) == 2 and all(float(diff) <= 1e-5 for row in rows for diff in row), out
    assert "agree within" in out.splitlines()[-1], out


def test_a_disagreement_exits_with_one_error_line() -> None:
    agreement = importlib.import_module("scripts.bench.agreement")
    with pytest.raises(SystemExit, match=r"^error: losses disagree: largest relative difference 2.00e-03 > 1e-05$"):
        agreement.require_agreement("losses", 2e-3, rtol=1e-5)
    with pytest.raises(SystemExit):
        agreement.require_agreement("losses", float("nan"), rtol=1e-5)
    nan = float("nan")
    assert agreement.worst([1e-9, 2e-9]) == 2e-9 and agreement.worst([]) == 0.0
    assert all(agreement.worst(values) != agreement.worst(values) for values in ([1e-9, nan], [0.0, nan, 1.0]))


def test_peak_tensor_bytes_subtract_a_block_freed_where_the_profiler_did_not_see_it() -> None:
    fsdp = importlib.import_module("scripts.bench.fsdp")

    def event(ts: float, addr: int, nbytes: int, total: int) -> dict:
        return {"name": "[memory]", "ts": ts, "args": {"Addr": addr, "Bytes": nbytes, "Total Allocated": total}}

    events = [event(1, 0xA, 100, 100), event(2, 0xB, 50, 150), event(3, 0xB, -50, 100),
              # 0xA is freed on a thread the profiler does not follow: no event, the total stays high
              event(4, 0xC, 40, 140), event(5, 0xA, 30, 170), event(6, 0xD, 80, 250)]
    assert fsdp.peak_allocated(events, start_ts=0) == 150  # at ts 2; later totals less the unseen 100
    assert fsdp.peak_allocated(events, start_ts=4) == 150  # ts 6: 250 - 100 (ts 4 reads 140: still high)
    assert fsdp.peak_allocated(events[:4], start_ts=4) == 140  # not yet known to be freed: reads high


def test_tokenizer_bench_gives_each_format_the_ids_autotokenizer_gives(capsys) -> None:
    bench = importlib.import_module("scripts.bench.tokenizer_throughput")
    bench.main(["--quick"])
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "MB/s" not in line]
    assert len(rows) == 3 and all(row[5].strip() == "True" for row in rows), rows


def test_pp_bench_sinks_leave_plain_linears_weight_grads_to_w_with_the_plain_backwards_values() -> None:
    """The zb_h1 rows' "ours": without the sinks no GEMM would be deferred and W would do nothing."""
    import torch

    from parallel import weight_grads

    pp = importlib.import_module("scripts.bench.pp")
    cfg = pp.bench_config("tiny", 16, 1, "zb_h1", 2)
    tokens = pp.RandomTokens(2, 16, cfg.model.vocab_size).tokens(0)

    def backward(chunk: torch.nn.Module, mb: int) -> None:
        pp.token_loss_sum(chunk(tokens[mb : mb + 1, :-1]), tokens[mb : mb + 1, 1:]).backward()

    plain, deferred = pp.plain_chunks(cfg, 0)[0], pp.plain_chunks(cfg, 0)[0]
    for mb in range(2):
        backward(plain, mb)
    sinks = pp.GradSinks([deferred])
    assert len(sinks.weights) == 4 * cfg.model.n_layers + 1  # wqkv, wo, w13, w2 per block; the head
    with weight_grads.deferring():
        for mb in range(2):
            before = [None if w.grad is None else w.grad.clone() for w in sinks.weights]
            backward(deferred, mb)
            work = weight_grads.take()
            assert len(work) == len(sinks.weights)
            assert all(b is None and w.grad is None or torch.equal(w.grad, b) for w, b in zip(sinks.weights, before))
            with torch.no_grad():
                for gemm in work:
                    gemm()
    assert sinks.calls == 2 * len(sinks.weights)
    for (name, a), b in zip(plain.named_parameters(), deferred.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7, msg=name)
