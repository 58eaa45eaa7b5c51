"""Measures of token collapse (rank, similarity, consensus distance, attention sparsity)."""
from .measures import attention_sparsity, consensus_distance, mean_pairwise_cosine, numerical_rank

__all__ = ["mean_pairwise_cosine", "numerical_rank", "consensus_distance", "attention_sparsity"]
