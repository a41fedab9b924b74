"""The untrained AligneR initialisation, built in memory (``load_model("untrained")``; the trainer's ``init:
untrained``): MiniLM backbone as is, a seeded Gaussian projection 384 → 128 (a random map roughly preserves inner
products, so MaxSim over it behaves like MaxSim over MiniLM token states), salience heads W=0, b=1 (every real token
equally salient) and use_salience=False. The shipped ``aligner`` checkpoint was trained from it and is compared
against it; ``python -m pyserini_aligner.checkpoints.make_default --output <dir>`` writes it as a checkpoint folder.
"""
from __future__ import annotations

from pyserini_aligner.model import AlignerConfig, AlignerModel

SEED = 0
DESCRIPTION = ("Untrained AligneR initialisation: all-MiniLM-L6-v2 backbone unchanged, Gaussian projection "
               f"384->128 (seed {SEED}, N(0, 1/384)), salience heads W=0 b=1, use_salience=false. "
               "Regenerate with python -m pyserini_aligner.checkpoints.make_default --output <dir>.")


def default_config() -> AlignerConfig:
    """Config of the untrained baseline checkpoint."""
    return AlignerConfig(backbone="minilm", hidden_size=384, dim=128, query_maxlen=64, doc_maxlen=256,
                         keep_special=True, use_salience=False, salience_mode="lp", alpha_q=0.5, alpha_d=0.4,
                         eps=0.002, default_strategy="top-k:1", description=DESCRIPTION)


def untrained_model() -> AlignerModel:
    """The untrained initialisation, built in memory on the CPU (``load_model("untrained")`` returns it)."""
    model = AlignerModel(default_config())
    model.reset_heads(seed=SEED)
    return model
