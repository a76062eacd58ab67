"""The brain of one engine: sequences, paged blocks with a prefix cache, and the scheduler.

Pure Python + numpy (no torch), so routers and tests import it cheaply.
"""
from scheduler.block_manager import BlockManager
from scheduler.scheduler import (ScheduledBatch, ScheduledBatchOutput, Scheduler, SchedulerConfig,
                                 SeqUpdate)
from contracts.sampling import SamplingParams
from scheduler.sequence import Sequence, SequenceStatus, SequenceType
from scheduler.stats import CacheStats, SpecStats

__all__ = ["BlockManager", "CacheStats", "SamplingParams", "ScheduledBatch", "ScheduledBatchOutput",
           "Scheduler", "SchedulerConfig", "SeqUpdate", "Sequence", "SequenceStatus", "SequenceType",
           "SpecStats"]
