"""checkpoint.init_from_hf: a Llama saved by transformers starts training on tp=2 x dp=2 with exactly
its weights (each rank reads only its boxes) and the tokenizer.model it ships, gives transformers'
logits, and exports back bitwise."""

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from model.transformer import Transformer
from parallel.errors import ConfigError
from tests.e2e.launch import DATA_CACHE, REPO, train
from trainer.checkpoint.files import MANIFEST
from trainer.checkpoint.hf_folder import check_hf_folder, tensor_files
from trainer.checkpoint.state import load_full_weights
from trainer.config.rules import validate
from trainer.config.schema import TrainConfig, from_dict
from trainer.data.prepare import prepare_dataset

# An LR far below one ulp of any weight: the step-1 checkpoint holds the imported weights unchanged.
FROZEN = ("model=tiny", "seq_len=64", "steps=1", "checkpoint.freq=1", "optim.lr=1e-30", "optim.warmup_steps=0")
MAX_REL_DIFF = 1e-5  # of the logit scale; both sides fp32 eager attention


def tiny_llama(folder: Path, shard_size: str | None = None, **overrides) -> "transformers.LlamaForCausalLM":
    """transformers' own Llama with model=tiny's architecture (random init), saved to `folder`."""
    args = TrainConfig().model
    config = transformers.LlamaConfig(**{
        "vocab_size": args.vocab_size, "hidden_size": args.dim, "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads, "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
        "max_position_embeddings": 64, "tie_word_embeddings": False, "attn_implementation": "eager"} | overrides)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder, **({"max_shard_size": shard_size} if shard_size else {}))
    return model


def hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out |= load_file(file)
    return out


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # single-process DCP load is intended
def test_import_on_tp2_dp2_gives_transformers_logits_and_exports_back_bitwise(tmp_path):
    hf_dir = tmp_path / "hf"
    # Several shards and an index, as published models ship; pretrained for a longer context than seq_len.
    hf = tiny_llama(hf_dir, shard_size="100KB", max_position_embeddings=128)
    assert (hf_dir / "model.safetensors.index.json").is_file()
    # A sentencepiece model of the vocabulary, as an exported folder ships (the default data's).
    shipped, _ = prepare_dataset(None, None, 512, DATA_CACHE, True, print)
    shutil.copyfile(shipped.path, hf_dir / "tokenizer.model")
    dump = tmp_path / "run"
    started = train(4, dump, *FROZEN, "model_parallel_size=2", "model.sequence_parallel=true", "batch_size=2",
                    f"checkpoint.init_from_hf={hf_dir}")
    assert started.returncode == 0, started.stderr[-3000:]
    log = started.stdout + started.stderr
    assert f"initialized the weights from {hf_dir}\n" in log
    assert "seq_len=64 is within its max_position_embeddings=128; an export declares 64 unless given " \
        "--max-position-embeddings 128" in log
    ckpt = dump / "checkpoints" / "step_1"

    cfg = from_dict(json.loads((ckpt / "train_config.json").read_text()))
    ours = Transformer(cfg.model)
    ours.load_state_dict(load_full_weights(ckpt, cfg))
    tokens = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = hf(input_ids=tokens).logits, ours.eval()(tokens)
    rel_diff = ((got - expected).abs().max() / expected.abs().max()).item()
    print(f"hf import logits: max diff relative to the logit scale {rel_diff:.3e}")
    assert rel_diff < MAX_REL_DIFF

    out = tmp_path / "exported"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "export_hf.py"), str(ckpt), str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    # data.tokenizer=null: the run took the folder's tokenizer, not a newly trained one.
    assert (out / "tokenizer.model").read_bytes() == (hf_dir / "tokenizer.model").read_bytes()
    original, exported = hf_tensors(hf_dir), hf_tensors(out)
    assert original.keys() == exported.keys()
    for name, tensor in original.items():
        assert torch.equal(tensor, exported[name]), name

    # A resume takes the checkpoint's weights and tokenizer, and says that it did not read the folder,
    # which may be gone (a requeued job after a scratch purge).
    shutil.rmtree(hf_dir)
    frozen = [o for o in FROZEN if not o.startswith("steps=")]
    resumed = train(4, dump, *frozen, "steps=2", "optim.decay_steps=1", "model_parallel_size=2", "model.sequence_parallel=true",
                    "batch_size=2", f"checkpoint.init_from_hf={hf_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"checkpoint.init_from_hf={hf_dir}: not read, the weights come from the resumed step 1 checkpoint" \
        in resumed.stdout + resumed.stderr


def test_a_folder_that_does_not_describe_the_model_is_one_line(tmp_path):
    args = TrainConfig().model
    tiny_llama(tmp_path / "gqa4", num_key_value_heads=4)
    tiny_llama(tmp_path / "scaled", rope_scaling={"rope_type": "linear", "factor": 2.0})
    cases = {"gqa4": "num_key_value_heads=4 vs model.n_kv_heads=2", "scaled": "only the default RoPE",
             "missing": "no readable config.json"}
    tiny_llama(tmp_path / "two_thetas")
    config = json.loads((tmp_path / "two_thetas" / "config.json").read_text())
    config |= {"rope_theta": args.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    (tmp_path / "two_thetas" / "config.json").write_text(json.dumps(config))
    cases["two_thetas"] = "rope_theta=10000.0 and rope_parameters.rope_theta=500000.0"
    tiny_llama(tmp_path / "oversized")  # a vocabulary larger than config.json says: never cut silently
    tensors = load_file(tmp_path / "oversized" / "model.safetensors")
    tensors["model.embed_tokens.weight"] = torch.zeros(args.vocab_size + 64, args.dim)
    save_file(tensors, tmp_path / "oversized" / "model.safetensors", metadata={"format": "pt"})
    cases["oversized"] = (f"tensor model.embed_tokens.weight has shape [{args.vocab_size + 64}, {args.dim}], "
                          f"the configured model needs [{args.vocab_size}, {args.dim}]")
    # Hand-edited folders: JSON of the wrong shape, a damaged tensor file.
    for name, edit, fragment in (
        ("list_config", lambda c: [1, 2], "config.json holds a JSON list, not an object"),
        ("string_rope", lambda c: c | {"rope_parameters": "x"}, "config.json's rope_parameters='x' is not an object"),
        ("string_size", lambda c: c | {"hidden_size": str(c["hidden_size"])},
         f"hidden_size='{args.dim}' vs model.dim={args.dim}"),
        # The older spelling "type" asks for scaling too (transformers reads it): never trained unscaled.
        ("legacy_type", lambda c: c | {"rope_parameters": {"type": "linear", "factor": 4.0, "rope_theta": 10000.0}},
         "rope_parameters asks for 'linear' RoPE scaling"),
        ("v4_scaling", lambda c: c | {"rope_scaling": {"type": "dynamic", "factor": 8.0}},
         "rope_scaling asks for 'dynamic' RoPE scaling"),
        # Fields left out mean what transformers' LlamaConfig takes for them, named as such.
        ("no_kv_heads", lambda c: {k: v for k, v in c.items() if k != "num_key_value_heads"},
         f"num_key_value_heads={args.n_heads} vs model.n_kv_heads={args.n_kv_heads}"),
        ("no_eps", lambda c: {k: v for k, v in c.items() if k != "rms_norm_eps"},
         f"rms_norm_eps=1e-06 vs model.norm_eps={args.norm_eps}"),
        ("dropout", lambda c: c | {"attention_dropout": 0.1},
         "config.json has attention_dropout=0.1; this model supports only 0.0"),
        # Heads wider than hidden_size / num_attention_heads (Minitron's): transformers builds it, this model cannot.
        ("head_dim", lambda c: c | {"head_dim": 2 * c["hidden_size"] // c["num_attention_heads"]},
         f"config.json has head_dim={2 * args.head_dim}; this model supports only hidden_size / num_attention_heads"),
        # A quantized release: its weights stored quantized beside their scales, which an import would leave out.
        ("quantized", lambda c: c | {"quantization_config": {"quant_method": "fbgemm_fp8"}},
         "config.json has a quantization_config ('fbgemm_fp8'"),
    ):
        tiny_llama(tmp_path / name)
        config = json.loads((tmp_path / name / "config.json").read_text())
        (tmp_path / name / "config.json").write_text(json.dumps(edit(config)))
        cases[name] = fragment
    tiny_llama(tmp_path / "garbage")
    (tmp_path / "garbage" / "model.safetensors").write_bytes(b"\xff" * 64)
    cases["garbage"] = "model.safetensors is not a readable safetensors file"
    tiny_llama(tmp_path / "deep")
    (tmp_path / "deep" / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    cases["deep"] = "no readable config.json (RecursionError"
    for name, weight_map in (("list_map", ["model.safetensors"]), ("number_map", {"lm_head.weight": 3})):
        tiny_llama(tmp_path / name)
        (tmp_path / name / "model.safetensors").unlink()
        (tmp_path / name / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        cases[name] = "model.safetensors.index.json's weight_map is not an object of tensor name: file name"
    for dtype, name in ((torch.float8_e4m3fn, "F8_E4M3"), (torch.int8, "I8")):  # quantized, config.json silent
        tiny_llama(tmp_path / name)
        tensors = load_file(tmp_path / name / "model.safetensors")
        tensors["model.layers.0.self_attn.q_proj.weight"] = tensors["model.layers.0.self_attn.q_proj.weight"].to(dtype)
        save_file(tensors, tmp_path / name / "model.safetensors", metadata={"format": "pt"})
        cases[name] = f"tensor model.layers.0.self_attn.q_proj.weight is {name}, not a floating-point weight"
    tied = dataclasses.replace(args, tie_embeddings=True)
    tiny_llama(tmp_path / "tied", tie_word_embeddings=True)  # ships no lm_head: the embedding is the head
    cases["tied"] = "tie_word_embeddings=True vs model.tie_embeddings=False"
    tiny_llama(tmp_path / "tied_with_head", tie_word_embeddings=True)
    tensors = load_file(tmp_path / "tied_with_head" / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, tmp_path / "tied_with_head" / "model.safetensors", metadata={"format": "pt"})
    cases["tied_with_head"] = "tie_word_embeddings=true, but it ships lm_head.weight too"
    for name, fragment in cases.items():
        with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace("[", r"\[")) as e:
            check_hf_folder(tmp_path / name, tied if name == "tied_with_head" else args)
        assert "checkpoint.init_from_hf=" in str(e.value) and "\n" not in str(e.value)
    tiny_llama(tmp_path / "untied")
    with pytest.raises(ConfigError, match="tie_word_embeddings=False vs model.tie_embeddings=True"):
        check_hf_folder(tmp_path / "untied", tied)
    check_hf_folder(tmp_path / "tied", tied)
    # What transformers computes the same way imports: default RoPE named explicitly, "swish" for silu.
    config = json.loads((tmp_path / "tied" / "config.json").read_text())
    (tmp_path / "tied" / "config.json").write_text(json.dumps(
        config | {"rope_scaling": {"rope_type": "default"}, "hidden_act": "swish"}))
    check_hf_folder(tmp_path / "tied", tied)
    assert args.rope_theta == 10000.0  # transformers' default: a config.json may leave it out
    (tmp_path / "tied" / "config.json").write_text(json.dumps(
        {k: v for k, v in config.items() if k not in ("rope_theta", "rope_parameters")}))
    check_hf_folder(tmp_path / "tied", tied)


def test_validate_refuses_another_tokenizer_when_starting_from_the_folder_only(tmp_path):
    """Before any process group: the refusal (tests/unit/test_hf_tokenizer.py) applies where the weights
    come from the folder, not to a resume, whose checkpoint holds weights trained with data.tokenizer."""
    tiny_llama(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.model").write_bytes(b"the folder's sentencepiece model")
    (tmp_path / "other.model").write_bytes(b"another sentencepiece model")
    cfg = TrainConfig()
    cfg = dataclasses.replace(cfg, dump_dir=str(tmp_path / "run"),
                              checkpoint=dataclasses.replace(cfg.checkpoint, init_from_hf=str(tmp_path / "hf")),
                              data=dataclasses.replace(cfg.data, tokenizer=str(tmp_path / "other.model")))
    with pytest.raises(ConfigError, match="set data.tokenizer=null to use the folder's"):
        validate(cfg, world_size=1)
    (tmp_path / "run" / "checkpoints" / "step_1").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step_1" / MANIFEST).write_text("{}")  # complete: resumed, not imported
    validate(cfg, world_size=1)


def test_a_single_file_wins_over_stale_shards_as_in_transformers(tmp_path):
    folder = tmp_path / "hf"
    tiny_llama(folder, shard_size="100KB")
    tiny_llama(tmp_path / "single")
    (tmp_path / "single" / "model.safetensors").rename(folder / "model.safetensors")
    assert set(tensor_files(folder).values()) == {folder / "model.safetensors"}
