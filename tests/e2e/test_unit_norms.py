"""metrics.unit_norms: per FSDP unit gradient and parameter norms, whole model. Step 1's parameter norms
equal those of the initial weights built in this process; the gradient norms add up (in squares) to
grad_norm; and tp2+SP x pp2 and HSDP 2x2 log the one-process values (TP-replicated norm weights counted
once, replicas not twice, units spread over stages all present). Logging them changes no bit of training."""

import math

from model.init import init_weights
from model.transformer import Transformer
from tests.e2e.launch import train_ok
from trainer.config.schema import from_dict
from trainer.parallelize import model_unit_names

RUN = ("model=tiny", "seq_len=64", "steps=2", "batch_size=4", "log_all_steps=true", "metrics.unit_norms=true")


def _initial_unit_norms() -> dict[str, float]:
    cfg = from_dict({"model": {"name": "tiny"}, "seq_len": 64})
    model = Transformer(cfg.model)
    init_weights(model, cfg.model, cfg.seed)
    return {name: math.sqrt(sum(float(p.detach().double().pow(2).sum()) for p in model.get_submodule(name).parameters()))
            for name in model_unit_names(cfg.model.n_layers)}


def test_unit_norms_match_the_initial_weights_the_grad_norm_and_every_layout(tmp_path):
    one = train_ok(0, tmp_path / "one", *RUN)
    names = list(one[0]["unit_grad_norms"])
    assert names == ["tok_embeddings", "layers.0", "layers.1", "head"]
    for name, norm in _initial_unit_norms().items():
        assert math.isclose(one[0]["unit_param_norms"][name], norm, rel_tol=1e-5), name
    for record in one:
        squares = sum(v * v for v in record["unit_grad_norms"].values())
        assert math.isclose(math.sqrt(squares), record["grad_norm"], rel_tol=1e-5), record["step"]
    assert one[1]["unit_param_norms"] != one[0]["unit_param_norms"]  # the update moved every unit
    plain = train_ok(0, tmp_path / "plain", *RUN[:-1])
    assert [(r["loss"], r["grad_norm"]) for r in plain] == [(r["loss"], r["grad_norm"]) for r in one]  # bitwise
    assert "unit_grad_norms" not in plain[0]
    layouts = {
        "tp2sp_pp2": train_ok(4, tmp_path / "tp2pp2", *RUN, "microbatch_size=2", "model_parallel_size=2",
                              "model.sequence_parallel=true", "pipeline_parallel_size=2"),
        "hsdp2x2": train_ok(4, tmp_path / "hsdp", *RUN, "batch_size=1", "dp_replicate=2"),
    }
    for layout, records in layouts.items():
        # The same initial weights give the same logged norms whatever the partial sums (fp64, logged as
        # fp32): compare_runs can tell a layout from a change.
        assert records[0]["unit_param_norms"] == one[0]["unit_param_norms"], layout
        for record, want in zip(records, one, strict=True):
            for field in ("unit_grad_norms", "unit_param_norms"):
                for name in names:
                    assert math.isclose(record[field][name], want[field][name], rel_tol=1e-5), (layout, field, name)
