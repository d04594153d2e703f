"""scripts/export_hf.py --help: whole sentences, every option explained."""

import pytest

from scripts.export_hf import main


def test_the_help_ends_its_sentences_and_explains_every_option(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert ("Export a training checkpoint as a Hugging Face Llama folder: config.json, the weights (safetensors, "
            "sharded past --max-shard-size) and the run's tokenizer.") in text
    assert "--dtype {bf16,fp32} the dtype of the exported weights (default: fp32)" in text
