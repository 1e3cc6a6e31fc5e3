"""Shape bucketing: the padding-safety plan, the bucket table, and per-bucket graph capture.

The runtime wrapper that pads prompts and dispatches to the bucket graphs is ttftc.bucketed.
"""

from ttftc.buckets.program import GraphProgram, GraphSignature
from ttftc.buckets.plan import BucketPlan
from ttftc.buckets.table import DEFAULT_BUCKETS, bucket_for, effective_buckets

__all__ = ["BucketPlan", "DEFAULT_BUCKETS", "GraphProgram", "GraphSignature", "bucket_for", "effective_buckets"]
