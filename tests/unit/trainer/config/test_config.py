"""Config parsing and the static rules: every key of the contract exists, bad values are one line."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from model.args import RopeScaling
from parallel.errors import ConfigError
from tests import REPO
from parallel.launch_env import LaunchEnv
from trainer.config.cli import check_overrides
from trainer.config.rules import fusion_note, layout_noops, start_notes, validate
from trainer.config.schema import NOT_SUPPORTED_YET, TrainConfig, from_dict, get_key, unknown_key
from trainer.observability import wandb_run

CONF = REPO / "conf"
CONTRACT_KEYS = (
    "dump_dir steps seed batch_size microbatch_size seq_len model_parallel_size pipeline_parallel_size "
    "context_parallel_size num_layers_per_virtual_pipeline_stage pipeline_schedule context_parallel_comm "
    "compute_dtype dp_replicate reshard_after_forward optimize_backward_concat enable_deterministic_training "
    "log_freq log_all_steps profile_freq dump_profile_traces profile_with_stack mem_snapshot_stop_step "
    "model.n_layers model.dim model.n_heads model.n_kv_heads model.sequence_parallel model.layer_ckpt "
    "model.efficient_attn model.attn_bias_type model.use_te_layers model.use_fp8 model.fp8_wgrad "
    "model.fp8_format model.fp8_margin model.fp8_amax_history_len model.fp8_amax_compute_algo model.fp8_all_gather "
    "optim.lr optim.use_fp32_copy_optim checkpoint.freq data.source"
).split()


def load(*overrides: str) -> TrainConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        raw = compose(config_name="config", overrides=list(overrides))
    return from_dict(OmegaConf.to_container(raw, resolve=True))


@pytest.mark.parametrize("model", ["tiny", "small", "llama3_8b", "llama3_1_8b", "llama3_2_1b", "llama3_70b",
                                   "llama3_405b"])
def test_every_model_config_is_valid_and_has_the_contract_keys(model):
    cfg = load(f"model={model}")
    for key in CONTRACT_KEYS:
        get_key(cfg, key)
    validate(cfg, world_size=8)


def test_the_product_launch_command_is_valid_on_8_ranks():
    """tp2 x pp2 x dp2 with two layers per virtual stage: virtual stages alone turn on interleaving."""
    cfg = load("model=small", "model_parallel_size=2", "pipeline_parallel_size=2",
               "num_layers_per_virtual_pipeline_stage=2", "batch_size=4", "reshard_after_forward=false",
               "optimize_backward_concat=true", "enable_deterministic_training=true")
    validate(cfg, world_size=8)
    assert cfg.virtual_pipeline_stages == 2


def test_llama3_8b_dimensions():
    args = load("model=llama3_8b").model
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.ffn_hidden_dim) == (4096, 32, 32, 8, 14336)


def test_llama3_2_1b_is_tied_and_shaped_as_published():
    args = load("model=llama3_2_1b").model
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.ffn_hidden_dim, args.vocab_size,
            args.head_dim, args.rope_theta, args.rope_scaling.factor) == (2048, 16, 32, 8, 8192, 128256, 64, 5e5, 32.0)
    assert args.tie_embeddings and not load("model=llama3_1_8b").model.tie_embeddings
    # Tied copies on the first and last stages, interleaved too, on any TP.
    validate(load("model=tiny", "model.tie_embeddings=true", "pipeline_parallel_size=2", "model_parallel_size=2",
                  "num_layers_per_virtual_pipeline_stage=1"), world_size=4)


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (["model_parallel_size=3"], 3, "model.n_heads=4 is not divisible by model_parallel_size=3"),
        (["model.n_kv_heads=4", "model.n_heads=6", "model.dim=96"], 1, "model.n_heads=6 is not divisible by model.n_kv_heads=4"),
        (["dp_replicate=3"], 4, "world size 4 is not divisible by"),
        (["reduce_dtype=fp8"], 1, "reduce_dtype=fp8 is not one of: bf16 | fp32"),
        (["model_parallel_size=4"], 4, "model.n_kv_heads=2 is not divisible by model_parallel_size=4"),
        (["model_parallel_size=4", "model.n_kv_heads=4", "model.multiple_of=1"], 4,
         "ffn hidden size (model.dim, model.ffn_dim_multiplier, model.multiple_of)=170 is not divisible by model_parallel_size=4"),
        (["model_parallel_size=2", "model.intermediate_size=33"], 2,
         "model.intermediate_size=33 is not divisible by model_parallel_size=2"),
        (["model_parallel_size=2", "model.vocab_size=511"], 2, "model.vocab_size=511 is not divisible by model_parallel_size=2"),
        (["model_parallel_size=2", "model.sequence_parallel=true", "seq_len=63"], 2,
         "seq_len=63 is not divisible by model_parallel_size (model.sequence_parallel=true)=2"),
        (["microbatch_size=3"], 1, "batch_size=4 is not divisible by microbatch_size=3"),
        (["batch_size=1000000000"], 1, "batch_size / microbatch_size = 1000000000 microbatches per step is more than 16384"),
        (["batch_size=16384", "pipeline_parallel_size=8", "model.n_layers=8"], 8,
         "batch_size / microbatch_size = 16384 microbatches through 8 pipeline chunks (pipeline_parallel_size x virtual "
         "stages) is 131072 scheduled forwards per step, more than 65536"),
        (["compute_dtype=fp16"], 1, "compute_dtype=fp16 is not one of: null | bf16 | fp32"),
        (["model.layer_ckpt=some"], 1, "model.layer_ckpt=some is not one of"),
        (["steps=0"], 1, "steps=0 must be > 0"),
        (["optim.beta2=1.0"], 1, "optim.beta2=1.0 must be in [0, 1)"),
        (["optim.eps=0"], 1, "optim.eps=0.0 must be >= 1.175e-38 (> 0 in fp32): AdamW divides by sqrt(v) + eps"),
        (["optim.eps=1e-40"], 1, "optim.eps=1e-40 must be >= 1.175e-38"),
        (["model.ffn_dim_multiplier=0"], 1, "model.ffn_dim_multiplier=0.0 must be > 0 (or null)"),
        (["model.ffn_dim_multiplier=0.001"], 1, "ffn hidden size (model.dim, model.ffn_dim_multiplier, "
         "model.multiple_of)=0 must be >= 1"),
        (["model.norm_eps=1e-50"], 1, "model.norm_eps=1e-50 must be >= 1.175e-38 (> 0 in fp32)"),
        (["seq_len=30", "context_parallel_size=2"], 2, "seq_len=30 is not divisible by 2 x context_parallel_size = 4 (each CP rank"),
        (["context_parallel_size=3", "seq_len=126"], 4,
         "world size 4 is not divisible by model_parallel_size=1 x pipeline_parallel_size=1 x context_parallel_size=3"),
        (["context_parallel_size=2", "model_parallel_size=4", "model.n_kv_heads=4", "model.sequence_parallel=true",
          "seq_len=36"], 8, "seq_len / context_parallel_size=18 is not divisible by model_parallel_size (model.sequence_parallel=true)=4"),
        (["context_parallel_comm=ulysses"], 1, "context_parallel_comm=ulysses is not one of: all_gather | ring"),
        (["model.n_layers=6", "pipeline_parallel_size=4"], 4, "model.n_layers=6 is not divisible by pipeline_parallel_size=4"),
        (["model.n_layers=6", "pipeline_parallel_size=2", "num_layers_per_virtual_pipeline_stage=2"], 2,
         "model.n_layers=6 is not divisible by pipeline_parallel_size x num_layers_per_virtual_pipeline_stage=4"),
        (["pipeline_parallel_size=2", "pipeline_schedule=interleaved_1f1b"], 2,
         "pipeline_schedule=interleaved_1f1b needs at least 2 virtual stages per rank, got 1"),
        (["model.n_layers=4", "pipeline_parallel_size=2", "num_layers_per_virtual_pipeline_stage=1",
          "pipeline_schedule=gpipe"], 2,
         "pipeline_schedule=gpipe runs one chunk per rank, but num_layers_per_virtual_pipeline_stage gives 2"),
        (["model.n_layers=4", "pipeline_parallel_size=2", "num_layers_per_virtual_pipeline_stage=1",
          "pipeline_schedule=zb_h1"], 2,
         "pipeline_schedule=zb_h1 runs one chunk per rank, but num_layers_per_virtual_pipeline_stage gives 2"),
        (["pipeline_parallel_size=2", "pipeline_schedule=zb_h1", "compile=true"], 2,
         "compile=true with pipeline_schedule=zb_h1 is not supported"),
        (["gradient_accumulation_fusion=true", "compile=true"], 1,
         "compile=true with gradient_accumulation_fusion=true is not supported"),
        (["model.efficient_attn=cudnn", "enable_deterministic_training=true"], 1,
         "model.efficient_attn=cudnn with enable_deterministic_training=true: cuDNN attention's backward is not "
         "deterministic"),
        (["pipeline_schedule=zero_bubble"], 1,
         "pipeline_schedule=zero_bubble is not one of: gpipe | 1f1b | interleaved_1f1b | zb_h1 | zbv"),
        (["pipeline_parallel_size=2", "pipeline_schedule=zbv"], 2,
         "pipeline_schedule=zbv runs exactly 2 chunks per rank, got 1: set num_layers_per_virtual_pipeline_stage"),
        # The count it asks for is of stages, the adjusted ends one each (n_layers / (pp x L) misled here).
        (["model.n_layers=10", "pipeline_parallel_size=2", "num_layers_per_virtual_pipeline_stage=2",
          "pipeline_first_stage_layers=1", "pipeline_last_stage_layers=1", "pipeline_schedule=zbv"], 2,
         "pipeline_schedule=zbv runs exactly 2 chunks per rank, got 3: set num_layers_per_virtual_pipeline_stage so "
         "that the stages number 2 x pipeline_parallel_size (model.n_layers / num_layers_per_virtual_pipeline_stage, "
         "where pipeline_first_stage_layers and pipeline_last_stage_layers, if set, are one stage each"),
        (["model.n_layers=4", "pipeline_parallel_size=2", "num_layers_per_virtual_pipeline_stage=1",
          "pipeline_schedule=zbv", "compile=true"], 2, "compile=true with pipeline_schedule=zbv is not supported"),
        (["model.n_layers=4", "pipeline_parallel_size=2", "num_layers_per_virtual_pipeline_stage=1",
          "pipeline_schedule=zbv", "model.tie_embeddings=true"], 2,
         "model.tie_embeddings=true with pipeline_schedule=zbv is not supported yet: the V places"),
        (["pipeline_parallel_size=2", "batch_size=3", "microbatch_size=2"], 2, "batch_size=3 is not divisible by microbatch_size=2"),
        (["dump_profile_traces=true"], 1, "dump_profile_traces=true needs profile_freq > 0"),
        (["profile_freq=-1"], 1, "profile_freq=-1 must be >= 0"),
        (["profile_freq=11", "steps=10"], 1, "profile_freq=11 must be <= steps=10 (it profiles every 11th step"),
        (["model.use_fp8=true", "model.dim=72", "model.n_heads=4"], 1,
         "model.use_fp8=true needs every fp8 GEMM dimension divisible by 16 (torch._scaled_mm): model.dim = 72 is not"),
        (["model.use_fp8=true", "model_parallel_size=8", "model.n_heads=8", "model.n_kv_heads=8"], 8,
         "(q + 2 kv heads) x head_dim / model_parallel_size = 24 is not"),
        (["model.use_fp8=true", "seq_len=24"], 1,
         "microbatch_size x seq_len / context_parallel_size (model.fp8_wgrad=true) = 24 is not"),
        (["model.fp8_all_gather=true"], 1, "model.fp8_all_gather=true needs model.use_fp8=true"),
        (["model.fp8_wgrad=false"], 1, "model.fp8_wgrad=false needs model.use_fp8=true"),
        (["model.use_fp8=true", "model.fp8_format=e5m2"], 1, "model.fp8_format=e5m2 is not one of: hybrid | e4m3"),
        (["model.use_fp8=true", "model.fp8_amax_history_len=0"], 1, "model.fp8_amax_history_len=0 must be > 0"),
        (["model.fp8_format=e4m3"], 1, "model.fp8_format=e4m3 needs model.use_fp8=true"),
        (["model.fp8_margin=1"], 1, "model.fp8_margin=1 needs model.use_fp8=true"),
        (["optim.clip_grad_norm=nan"], 1, "optim.clip_grad_norm=nan must be a finite number"),
        (["comm_timeout_s=inf"], 1, "comm_timeout_s=inf must be a finite number"),
        (["comm_timeout_s=1e15"], 1, "comm_timeout_s=1000000000000000.0 must be in [1, 604800] seconds"),
        (["comm_timeout_s=0.001"], 1, "comm_timeout_s=0.001 must be in [1, 604800] seconds"),
        (["model.vocab_size=100000000000"], 1, "model.vocab_size=100000000000 must be <= 2147483647"),
        (["optim.lr=1e308"], 1, "optim.lr=1e+308 must be <= 3.403e+38 (it is used in fp32)"),
        (["model.norm_eps=1e39"], 1, "model.norm_eps=1e+39 must be <= 3.403e+38 (it is used in fp32)"),
        (["model.rope_theta=1e300"], 1, "model.rope_theta=1e+300 must be <= 3.403e+38 (it is used in fp32)"),
        (["optim.lr=3e-3", "optim.weight_decay=1000"], 1,
         "optim.lr x optim.weight_decay = 3 must be < 1: each step multiplies the weights by 1 - lr x weight_decay"),
        (["model.use_fp8=true", "model.fp8_margin=1000"], 1, "model.fp8_margin=1000 must be <= 16: the scale keeps"),
        (["model.use_fp8=true", "model.fp8_amax_history_len=1000000000"], 1,
         "model.fp8_amax_history_len=1000000000 must be <= 65536"),
        (["data.max_bad_fraction=0.5"], 1,
         "data.max_bad_fraction=0.5 needs data.bad_records=skip (with error the first bad record stops the run)"),
        (["checkpoint.init_from_hf="], 1, "checkpoint.init_from_hf is an empty string (use null to leave it unset)"),
        (["model.name="], 1, "model.name is an empty string (it needs a value)"),
        (["resume.allow_changed=[model_parallel_size]"], 1,
         "resume.allow_changed: model_parallel_size is not a key a resume lets change"),
        (["optimize_backward_concat=true", "grad_reduce=per_microbatch"], 1,
         "optimize_backward_concat=true needs grad_reduce=last_microbatch"),
        (["seed=4294967296"], 1, "seed=4294967296 must be <= 4294967295"),
        (["steps=3", "mem_snapshot_stop_step=5"], 1, "mem_snapshot_stop_step=5 must be <= steps=3"),
        (["steps=8", "optim.warmup_steps=10", "optim.decay_steps=5"], 1,
         "optim.decay_steps=5 must be >= optim.warmup_steps=10 when steps=8 runs past it"),
        (["eval.steps=3"], 1, "eval.steps=3 needs eval.freq > 0; without it the key changes nothing"),
        (["checkpoint.async_save=true"], 1, "checkpoint.async_save=true needs checkpoint.freq > 0"),
        (["optim.decay_start=5"], 1, "optim.decay_start=5 must be >= optim.warmup_steps=10"),
        (["optim.decay_start=100"], 1, "optim.decay_start=100 must be < where the decay ends, 100"),
        (["optim.decay_style=linear", "optim.min_lr_ratio=1"], 1, "optim.decay_style=linear needs optim.min_lr_ratio < 1"),
        (["optim.decay_steps=50", "optim.min_lr_ratio=1"], 1, "optim.decay_steps=50 needs optim.min_lr_ratio < 1"),
        (["optim.decay_style=square"], 1, "optim.decay_style=square is not one of: cosine | linear"),
        (["data.bad_records=drop"], 1, "data.bad_records=drop is not one of: error | skip"),
        (["data.max_bad_fraction=1.5"], 1, "data.max_bad_fraction=1.5 must be in [0, 1]"),
        (["checkpoint.keep=2"], 1, "checkpoint.keep=2 needs checkpoint.freq > 0 or a stop_signal"),
        (["log_all_steps=true", "log_freq=5"], 1, "log_freq=5 needs log_all_steps=false"),
        (["log_all_steps=true", "log_freq=2"], 1, "log_freq=2 needs log_all_steps=false"),
        (["model.rope_scaling={type:yarn}"], 1,
         "model.rope_scaling.type=yarn is not supported: only llama3 (Llama 3.1's RoPE scaling) is"),
        (["model.rope_scaling={factor:0.5}"], 1, "model.rope_scaling.factor=0.5 must be >= 1"),
        (["model.rope_scaling={low_freq_factor:0}"], 1, "model.rope_scaling.low_freq_factor=0.0 must be > 0"),
        (["model.rope_scaling={low_freq_factor:4}"], 1,
         "model.rope_scaling.high_freq_factor=4.0 must be > model.rope_scaling.low_freq_factor=4.0"),
        (["model.rope_scaling={original_max_position_embeddings:0}"], 1,
         "model.rope_scaling.original_max_position_embeddings=0 must be > 0"),
        (["model.tie_embeddings=true", "num_layers_per_virtual_pipeline_stage=1"], 1,
         "model.tie_embeddings=true with num_layers_per_virtual_pipeline_stage on one pipeline rank "
         "(pipeline_parallel_size=1) is not supported yet"),
        (["model.tie_embeddings=yes"], 1, "model.tie_embeddings='yes' must be bool"),
        (["metrics.wandb_project=llama"], 1, "metrics.wandb_project=llama needs metrics.wandb=true; without it the key"),
        (["metrics.wandb_tags=[a,b]"], 1, "metrics.wandb_tags=['a', 'b'] needs metrics.wandb=true"),
    ],
)
def test_rule_violations_are_one_line(overrides, world, message):
    with pytest.raises(ConfigError) as err:
        validate(load(*overrides), world_size=world)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_settings_that_ask_for_what_another_gives_are_accepted():
    """log_freq=1 and log_all_steps=true both log every step: nothing the user asked for is ignored."""
    cfg = load("log_all_steps=true", "log_freq=1")
    validate(cfg, world_size=1)
    assert cfg.log_freq == 1 and cfg.log_all_steps


@pytest.mark.parametrize("overrides, world", [
    (["pipeline_schedule=zb_h1"], 1),
    (["pipeline_schedule=zb_h1", "pipeline_parallel_size=4", "model.n_layers=4", "batch_size=3"], 4),
    (["pipeline_schedule=zb_h1", "pipeline_parallel_size=2", "model_parallel_size=2", "model.sequence_parallel=true",
      "model.layer_ckpt=selective", "reshard_after_forward=false"], 4),
])
def test_zero_bubble_h1_is_accepted_on_one_chunk_per_rank(overrides, world):
    validate(load(*overrides), world_size=world)


def test_zero_bubble_v_is_accepted_on_two_chunks_per_rank_with_the_v_placement():
    cfg = load("pipeline_schedule=zbv", "pipeline_parallel_size=2", "model.n_layers=4",
               "num_layers_per_virtual_pipeline_stage=1", "model_parallel_size=2", "model.layer_ckpt=full")
    validate(cfg, world_size=4)
    assert cfg.virtual_pipeline_stages == 2 and cfg.pipeline_v_shape and not load().pipeline_v_shape


def test_gradient_accumulation_fusion_under_bf16_compute_is_named_a_no_op():
    fused = load("gradient_accumulation_fusion=true")
    assert fusion_note(fused, "bf16").startswith("gradient_accumulation_fusion=true changes nothing with bf16 compute")
    assert fusion_note(fused, "fp32") is None and fusion_note(load(), "bf16") is None


def test_a_zero_learning_rate_is_accepted_with_a_note_and_a_negative_one_refused():
    frozen = load("optim.lr=0")
    assert start_notes(frozen, validate(frozen, world_size=1)) == [
        "optim.lr=0: the weights will not change (the optimizer steps with a learning rate and a weight decay of 0); "
        "the loss measures the model as loaded"]
    default = load()
    assert start_notes(default, validate(default, world_size=1)) == []
    with pytest.raises(ConfigError, match=r"^optim.lr=-0.001 must be >= 0$"):
        validate(load("optim.lr=-1e-3"), world_size=1)


def test_te_blocks_under_tp_say_their_collectives_are_not_in_the_metrics():
    """(validate refuses TE blocks without CUDA: the layout is given here.)"""
    from parallel.mesh import ParallelDims

    te_tp = load("model.use_te_layers=true", "model_parallel_size=2")
    notes = start_notes(te_tp, ParallelDims.from_sizes(2, model_parallel_size=2))
    assert any(n.startswith("model.use_te_layers=true with model_parallel_size > 1: TransformerEngine issues") for n in notes)
    assert start_notes(load("model.use_te_layers=true"), ParallelDims.from_sizes(1)) == []


def test_an_unquoted_tilde_says_how_to_write_it(capsys):
    """The shell leaves `~` after `=` as it is, and hydra's grammar refuses it with a bare lexer error."""
    with pytest.raises(SystemExit) as exit_:
        check_overrides(["data.source=~/corpus"], LaunchEnv(rank=0, local_rank=0, world_size=1, torchrun=False,
                                                            run_id="t"))
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        "error: data.source=~/corpus: `~` must be quoted or expanded by the shell, e.g. data.source='~/corpus' (the "
        "trainer expands a leading ~ in its path keys) or data.source=$HOME/corpus\n")


@pytest.mark.parametrize("override, line", [
    # Added with +, a key the config derives was dropped as a saved run's copy: seq_len stayed as it was.
    ("+model.max_seq_len=4096", "error: model.max_seq_len is not set directly: it follows from seq_len\n"),
    ("model.max_seq_len=4096", "error: model.max_seq_len is not set directly: it follows from seq_len\n"),
    ("+model.valid_vocab_size=100", "error: model.valid_vocab_size is not set directly: it follows from the "
                                    "tokenizer's vocabulary (set model.vocab_size)\n"),
    # A group given as a dict names its bad key, not the group.
    ("optim={lrr:1}", "error: optim.lrr is not a known config key (did you mean optim.lr?)\n"),
])
def test_overrides_hydra_takes_but_the_config_would_misread_are_one_line(capsys, override, line):
    with pytest.raises(SystemExit) as exit_:
        check_overrides([override], LaunchEnv(rank=0, local_rank=0, world_size=1, torchrun=False, run_id="t"))
    assert exit_.value.code == 2 and capsys.readouterr().err == line


def test_an_integer_beyond_any_float_is_refused_for_a_float_key():
    with pytest.raises(ConfigError, match=r"^comm_timeout_s must be a finite number \(an integer of 401 digits"):
        load("comm_timeout_s=1" + "0" * 400)


def test_a_quoted_tilde_in_a_path_key_is_expanded(monkeypatch):
    monkeypatch.setenv("HOME", "/home/someone")
    check_overrides(["data.source='~/corpus'"], LaunchEnv(rank=0, local_rank=0, world_size=1, torchrun=False,
                                                         run_id="t"))
    cfg = load("data.source='~/corpus'", "data.tokenizer='~/tok.model'", "data.cache_dir='~/cache'",
               "checkpoint.init_from_hf='~/llama'", "dump_dir='~/runs/a'")
    assert (cfg.data.source, cfg.data.tokenizer, cfg.data.cache_dir, cfg.checkpoint.init_from_hf, cfg.dump_dir) == (
        "/home/someone/corpus", "/home/someone/tok.model", "/home/someone/cache", "/home/someone/llama",
        "/home/someone/runs/a")
    assert load().data.source == "stdlib" and load().checkpoint.init_from_hf is None


def test_keys_a_layout_makes_no_ops_are_accepted_and_named_in_the_log():
    """One set of overrides for every layout of a matrix: what a layout cannot use is a note, not an error."""
    overrides = ("model.sequence_parallel=true", "context_parallel_comm=ring", "model.efficient_attn=math",
                 "optimize_backward_concat=true", "reshard_after_forward=false", "batch_size=4")
    single = load(*overrides, "microbatch_size=4")
    assert layout_noops(single, validate(single, world_size=1)) == [
        "optimize_backward_concat=true changes nothing on this layout: it needs more than one microbatch",
        "reshard_after_forward=false changes nothing on this layout: it needs more than one rank per FSDP shard group",
        "model.sequence_parallel=true changes nothing on this layout: it needs model_parallel_size > 1",
        "context_parallel_comm=ring changes nothing on this layout: it needs context_parallel_size > 1",
    ]
    # FSDP shards over dp_shard x cp: with two CP ranks, reshard_after_forward=false is ZeRO-2 there.
    cp_only = load(*overrides, "microbatch_size=4", "context_parallel_size=2")
    assert not any(n.startswith("reshard_after_forward") for n in layout_noops(cp_only, validate(cp_only, world_size=2)))
    wide = load(*overrides, "model_parallel_size=2", "context_parallel_size=2")
    assert layout_noops(wide, validate(wide, world_size=8)) == []  # CP's chunk pairs run efficient_attn's kernel


UNBUILT_VALUES = {
    "optim.use_fp32_copy_optim": "false",
}


def test_capabilities_not_built_yet_are_rejected_not_ignored():
    assert {key for key, _ in NOT_SUPPORTED_YET} == UNBUILT_VALUES.keys()
    for key, value in UNBUILT_VALUES.items():
        with pytest.raises(ConfigError, match=f"^{key}={value} is not supported yet \\(only "):
            validate(load(f"{key}={value}"), world_size=16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_te_layers_without_cuda_say_how_to_get_them():
    with pytest.raises(ConfigError) as err:
        validate(load("model.use_te_layers=true", "model.use_fp8=true"), world_size=1)
    message = str(err.value)
    assert "model.use_te_layers=true needs CUDA and TransformerEngine" in message and "pip install -e '.[te]'" in message


def test_wandb_without_its_package_is_one_line(monkeypatch):
    wanted = ("metrics.wandb=true", "metrics.wandb_project=llama", "metrics.wandb_tags=[a]")
    validate(load(*wanted), world_size=1)  # installed here (the dev extra includes the wandb one)
    find_spec = wandb_run.importlib.util.find_spec
    monkeypatch.setattr(wandb_run.importlib.util, "find_spec", lambda name: None if name == "wandb" else find_spec(name))
    with pytest.raises(ConfigError, match=r"^metrics.wandb=true needs the wandb package, which is not installed: "
                                          r"pip install -e '\.\[wandb\]' \(or metrics.wandb=false\)$"):
        validate(load(*wanted), world_size=1)


@pytest.mark.parametrize("overrides, message", [
    (["grad_reduce=per_microbatch"], "model.use_te_layers=true needs grad_reduce=last_microbatch"),
    (["model.use_fp8=true", "model.fp8_all_gather=true"], "model.fp8_all_gather=true gathers the in-tree"),
    (["model.use_fp8=true", "model.layer_ckpt=full"], "model.layer_ckpt=full with model.use_te_layers=true"),
    (["model.use_fp8=true", "nan_policy=skip"], "nan_policy=skip with model.use_te_layers=true"),
    (["model.use_fp8=true", "model.fp8_wgrad=false"], "model.fp8_wgrad=false with model.use_te_layers=true"),
    (["compile=true"], "compile=true with model.use_te_layers=true is not supported"),
])
def test_te_layers_refuse_what_they_cannot_combine_with_on_any_machine(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate(load("model.use_te_layers=true", *overrides), world_size=1)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_wrong_types_and_unknown_keys():
    with pytest.raises(ConfigError, match="seed='x' must be int"):
        from_dict({"seed": "x"})
    with pytest.raises(ConfigError, match=r"^optim.lrr is not a known config key \(did you mean optim.lr\?\)$"):
        from_dict({"optim": {"lrr": 1}})
    with pytest.raises(ConfigError, match=r"^qqqq is not a known config key$"):
        from_dict({"qqqq": 1})


def test_rope_scaling_is_null_or_a_group_of_llama_3_1_defaults():
    assert load().model.rope_scaling is None
    scaling = load("model.rope_scaling={factor:32.0}").model.rope_scaling
    assert scaling == RopeScaling(factor=32.0) and RopeScaling() == RopeScaling(
        "llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    validate(load("model.rope_scaling={}"), world_size=1)
    for value, message in (
        (3, r"^model.rope_scaling must be a group of keys or null, got 3$"),
        ({"factr": 2}, r"^model.rope_scaling.factr is not a known config key \(did you mean "
                       r"model.rope_scaling.factor\?\)$"),
        ({"factor": "x"}, r"^model.rope_scaling.factor='x' must be float$"),
    ):
        with pytest.raises(ConfigError, match=message):
            from_dict({"model": {"rope_scaling": value}})
    # Hydra cannot set a key of a group that is null: the command line is told how to.
    assert unknown_key("model.rope_scaling.factor") == (
        "model.rope_scaling.factor cannot be set where model.rope_scaling is null or lacks it: give the whole "
        "group, model.rope_scaling={key:value,...}, or add the key with +model.rope_scaling.factor=value")
    assert unknown_key("model.rope_scalng").endswith("(did you mean model.rope_scaling?)")


@pytest.mark.parametrize("overrides", [[], ["model.rope_scaling={factor:32.0,original_max_position_embeddings:4096}"]])
def test_train_config_json_reads_back_as_the_same_config(overrides):
    """train_config.json is dataclasses.asdict of the config; export_hf reads it back through from_dict."""
    cfg = load("seq_len=64", *overrides)
    assert from_dict(json.loads(json.dumps(dataclasses.asdict(cfg)))) == cfg


def test_dump_dir_expands_home_as_the_shell_would():
    """Quoted (`dump_dir='~/runs/a'`) or composed, `~` reaches the config unexpanded; data paths expand it."""
    assert from_dict({"dump_dir": "~/runs/a"}).dump_dir == str(Path.home() / "runs" / "a")
    assert from_dict({"dump_dir": "runs/~a"}).dump_dir == "runs/~a"


@pytest.mark.parametrize("version, accepted", [("1.12.0", False), ("2.0.0", True), ("2.20.2", True)])
def test_te_layers_need_transformer_engine_2(monkeypatch, request, version, accepted):
    """model/te.py uses TE 2.x's scaling state and recipe; an older TE (e.g. in an older container) is named."""
    monkeypatch.syspath_prepend(str(REPO / "tests" / "fake_te"))
    import transformer_engine

    request.addfinalizer(lambda: sys.modules.pop("transformer_engine", None))  # the stand-in stays in this test

    monkeypatch.setattr(transformer_engine, "__version__", version)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = load("model.use_te_layers=true", "model.use_fp8=true")
    if accepted:
        validate(cfg, world_size=1)
    else:
        with pytest.raises(ConfigError, match="needs TransformerEngine 2.0 or later .* the installed one is 1.12.0"):
            validate(cfg, world_size=1)


def test_an_init_from_hf_that_is_a_file_is_named_as_such(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x")
    with pytest.raises(ConfigError) as err:
        validate(load(f"checkpoint.init_from_hf={weights}"), world_size=1)
    assert str(err.value) == (f"checkpoint.init_from_hf={weights} is a file: name the Hugging Face model folder "
                              "(config.json, safetensors, tokenizer files)")
