"""Few-shot alignment adaptation: ``python -m pyserini_aligner.adapt --index <dir> --topics ... --qrels ...``."""
from pyserini_aligner.adapt.select import (ALPHA, CANDIDATE_STRATEGIES, MIN_GAIN, Adaptation, Choice, Fold,
                                           choose_strategy, few_shot_adaptation, make_folds,
                                           paired_permutation_test, per_query, rescore, strategy_table)

__all__ = ["ALPHA", "CANDIDATE_STRATEGIES", "MIN_GAIN", "Adaptation", "Choice", "Fold", "choose_strategy",
           "few_shot_adaptation", "make_folds", "paired_permutation_test", "per_query", "rescore", "strategy_table"]
