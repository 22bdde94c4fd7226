"""The OxyGen engine: frame scheduler over the unified KV pool, decode budgets, baselines."""

from oxygen_ros.engine.baselines import (IsolatedScheduler, make_system, ParallelSystem,
                                         SharedScheduler, SYSTEMS)
from oxygen_ros.engine.budget import AdaptiveBudget, FixedBudget, StepCostModel
from oxygen_ros.engine.frontend import (Frontend, identity_norm_stats, random_observation,
                                        random_setup)
from oxygen_ros.engine.scheduler import PRESSURE_POLICIES, Scheduler
from oxygen_ros.engine.types import (ActionOutput, FinishedRequest, FrameResult, Observation,
                                     TokenDelta, Timings)
from oxygen_ros.engine.workload import (default_num_slots, get_workload, LanguagePolicy,
                                        Workload, WORKLOADS)

__all__ = ['ActionOutput', 'AdaptiveBudget', 'default_num_slots', 'FinishedRequest',
           'FixedBudget', 'FrameResult', 'Frontend', 'get_workload', 'identity_norm_stats',
           'IsolatedScheduler', 'LanguagePolicy', 'make_system', 'Observation',
           'ParallelSystem', 'PRESSURE_POLICIES', 'random_observation', 'random_setup',
           'Scheduler', 'SharedScheduler', 'StepCostModel', 'SYSTEMS', 'TokenDelta', 'Timings',
           'Workload', 'WORKLOADS']
