"""Few-shot alignment adaptation: ``python -m pyserini_aligner.adapt --index <dir> --topics ... --qrels ...``."""
from pyserini_aligner.adapt.select import (CANDIDATE_STRATEGIES, Adaptation, choose_strategy, few_shot_adaptation,
                                           make_folds, per_query, rescore, strategy_table)

__all__ = ["CANDIDATE_STRATEGIES", "Adaptation", "choose_strategy", "few_shot_adaptation", "make_folds", "per_query",
           "rescore", "strategy_table"]
