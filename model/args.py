"""Model hyperparameters of a Llama-3-style decoder, and the sizes derived from them."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the config (and so every launcher's override check) reads these args without torch
    from model.fp8 import Fp8Recipe


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's RoPE scaling (transformers' rope_type "llama3"), with Llama 3.1's values as defaults:
    wavelengths longer than original_max_position_embeddings / low_freq_factor are stretched by `factor`,
    those shorter than original_max_position_embeddings / high_freq_factor kept, those between blended."""

    type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelArgs:
    n_layers: int = 2
    dim: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 512  # rows of the embedding and the output head
    # The tokenizer's ids, 0 .. valid_vocab_size - 1: the rows past them are padding (a vocabulary rounded
    # up for TP, or a Hugging Face folder's own), zero at init and never a target. None: no padding.
    valid_vocab_size: int | None = None
    ffn_dim_multiplier: float | None = None
    multiple_of: int = 32
    intermediate_size: int | None = None  # the SwiGLU hidden size as given (a Hugging Face config.json's)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = False  # the output projection is the embedding's weight (Llama 3.2 1B and 3B)
    max_seq_len: int = 128
    efficient_attn: str = "sdpa"
    use_fp8: bool = False
    fp8_format: str = "hybrid"
    fp8_margin: int = 0
    fp8_amax_history_len: int = 1024
    fp8_amax_compute_algo: str = "max"
    fp8_wgrad: bool = True

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """intermediate_size when given; else Llama's SwiGLU sizing: 2/3 of 4*dim, scaled, rounded up to a
        multiple of `multiple_of`."""
        if self.intermediate_size is not None:
            return self.intermediate_size
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def fp8_recipe(self) -> "Fp8Recipe | None":
        """The scaling recipe of the block linears' GEMMs; None when they run in the compute dtype."""
        if not self.use_fp8:
            return None
        from model.fp8 import Fp8Recipe

        return Fp8Recipe(self.fp8_format, self.fp8_margin, self.fp8_amax_history_len, self.fp8_amax_compute_algo,
                         self.fp8_wgrad)
