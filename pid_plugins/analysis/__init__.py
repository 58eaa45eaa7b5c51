"""Analysis tools: collapse measures, per-layer diagnostics and robustness for any zoo model (``measures`` needs only
torch; ``run`` backs ``pid-plugins diagnose`` and ``pid-plugins attack``).
"""
from .measures import attention_sparsity, consensus_distance, effective_rank, mean_pairwise_cosine, numerical_rank

__all__ = ["mean_pairwise_cosine", "numerical_rank", "effective_rank", "consensus_distance", "attention_sparsity"]
