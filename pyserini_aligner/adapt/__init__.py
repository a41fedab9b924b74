"""Few-shot adaptation: ``python -m pyserini_aligner.adapt --index <dir> --topics ... --qrels ...`` chooses the
alignment strategy and the checkpoint."""
from pyserini_aligner.adapt.select import (ALPHA, CANDIDATE_STRATEGIES, MIN_GAIN, Adaptation, Candidate, Choice, Fold,
                                           choose, few_shot_adaptation, make_folds, paired_permutation_test,
                                           paired_t, per_query, rescore, rescore_texts, strategy_table)

__all__ = ["ALPHA", "CANDIDATE_STRATEGIES", "MIN_GAIN", "Adaptation", "Candidate", "Choice", "Fold", "choose",
           "few_shot_adaptation", "make_folds", "paired_permutation_test", "paired_t", "per_query", "rescore",
           "rescore_texts", "strategy_table"]
