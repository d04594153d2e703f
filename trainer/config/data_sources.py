"""`data.source` as a list of sources (a blend) and `data.weights`: the rules between them, checked on every
rank before anything distributed starts. What each source holds is the data path's to check."""

import os

from parallel.errors import ConfigError
from trainer.config.schema import DataConfig

DEFAULT_CORPUS = "stdlib"


def check_sources(data: DataConfig) -> None:
    """One line for a list that names no source or one source twice, and for weights that do not fit it."""
    sources = data.sources
    if not sources:
        raise ConfigError("data.source=[] names no source: give a path, a list of paths, or null (the default corpus)")
    seen: dict[str, int] = {}
    for i, source in enumerate(sources):
        same = DEFAULT_CORPUS if source in (None, DEFAULT_CORPUS) else os.path.realpath(source)
        if same in seen:
            raise ConfigError(f"data.source names {source} twice (data.source[{seen[same]}] and data.source[{i}]); "
                              "list each source once and give it more weight in data.weights")
        seen[same] = i
    weights = data.weights
    if weights is None:
        return
    if len(sources) == 1:
        raise ConfigError(f"data.weights={weights} with a single data.source has nothing to blend; leave it null "
                          "(a blend is data.source=[a,b] data.weights=[wa,wb])")
    if len(weights) != len(sources):
        raise ConfigError(f"data.weights has {len(weights)} weights for the {len(sources)} sources of data.source; "
                          "give one per source, in the same order")
    for i, weight in enumerate(weights):
        if weight < 0:
            raise ConfigError(f"data.weights[{i}]={weight} must be >= 0")
    if not any(weights):
        raise ConfigError(f"data.weights={weights} are all 0: at least one source needs a positive weight")
