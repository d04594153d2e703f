"""model.attn_bias_type=block_causal end to end, on a corpus of short documents (several per 64-token
sequence): tp2+SP x pp2 (interleaved, 2 chunks per rank) with selective recompute, cp2 (all_gather) x dp2 with full recompute, and cp2
(ring) x tp2+SP give the one-process losses, gradient norms and eval losses; and the mask changes the
numbers (it is not a no-op)."""

import json
import math
import random

from tests.e2e.launch import train_ok

RUN = ("model=tiny", "model.n_layers=4", "seq_len=64", "steps=3", "optim.warmup_steps=1", "optim.lr=1e-2", "log_all_steps=true",
       "eval.freq=3", "eval.steps=1", "data.held_out_fraction=0.05")


def _short_documents(path) -> None:
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8))) for _ in range(500)]
    with path.open("w") as out:
        for _ in range(600):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(2, 12)))
            out.write(json.dumps({"text": text}) + "\n")


def test_block_causal_matches_one_process_on_every_layout_and_differs_from_causal(tmp_path):
    corpus = tmp_path / "docs.jsonl"
    _short_documents(corpus)
    data = (f"data.source={corpus}", f"data.cache_dir={tmp_path / 'cache'}")
    block = (*RUN, *data, "model.attn_bias_type=block_causal")
    one = train_ok(0, tmp_path / "one", *block, "batch_size=4")
    layouts = {
        "tp2sp_pp2_interleaved": train_ok(4, tmp_path / "tp2pp2", *block, "batch_size=4", "microbatch_size=2",
                              "model_parallel_size=2", "model.sequence_parallel=true", "pipeline_parallel_size=2",
                              "num_layers_per_virtual_pipeline_stage=1", "model.layer_ckpt=selective"),
        "cp2_all_gather_dp2": train_ok(4, tmp_path / "cp2dp2", *block, "batch_size=2", "context_parallel_size=2",
                                       "model.layer_ckpt=full"),
        "cp2_ring_tp2sp": train_ok(4, tmp_path / "cp2tp2", *block, "batch_size=4", "context_parallel_size=2",
                                   "context_parallel_comm=ring", "model_parallel_size=2",
                                   "model.sequence_parallel=true"),
    }
    for name, records in layouts.items():
        for record, want in zip(records, one, strict=True):
            for key in ("loss", "grad_norm", "eval_loss"):
                if key in want:
                    assert math.isclose(record[key], want[key], rel_tol=1e-5), (name, record["step"], key)
    assert "eval_loss" in one[-1]
    causal = train_ok(0, tmp_path / "causal", *RUN, *data, "batch_size=4")
    # At initialization attention is near uniform, so the mask shows once the model has learned a little.
    assert abs(causal[-1]["loss"] - one[-1]["loss"]) > 1e-3, (causal[-1]["loss"], one[-1]["loss"])
