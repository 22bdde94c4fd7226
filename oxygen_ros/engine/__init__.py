"""The OxyGen engine: scheduler, model runner, output processor, budgets, workloads.

The systems the benchmark compares it with (isolated, shared, parallel) are bench/systems.py.
"""

from oxygen_ros.engine.budget import (AdaptiveBudget, Budget, FixedBudget, StepCostModel,
                                      UnlimitedBudget)
from oxygen_ros.engine.engine import Engine, make_engine
from oxygen_ros.engine.fleet import (FleetActions, FleetEngine, FleetMember, FleetResult,
                                     FleetRobot, make_fleet)
from oxygen_ros.engine.frontend import (Frontend, identity_norm_stats, random_observation,
                                        random_setup, synthetic_frame)
from oxygen_ros.engine.output import OutputProcessor
from oxygen_ros.engine.runner import ModelRunner
from oxygen_ros.engine.scheduler import Admission, Scheduler, StepPlan
from oxygen_ros.engine.system import System
from oxygen_ros.engine.types import (ActionOutput, Continuation, FinishedRequest, FrameResult,
                                     Observation, ObservationError, TokenDelta, Timings)
from oxygen_ros.engine.workload import (default_num_slots, get_workload, LanguagePolicy,
                                        LanguageTask, NARRATION, Workload, WORKLOADS)
from oxygen_ros.kv import FinishReason

__all__ = ['ActionOutput', 'AdaptiveBudget', 'Admission', 'Budget', 'Continuation',
           'default_num_slots', 'Engine', 'FinishedRequest', 'FinishReason', 'FixedBudget',
           'FleetActions', 'FleetEngine', 'FleetMember', 'FleetResult', 'FleetRobot',
           'make_fleet', 'FrameResult', 'Frontend', 'get_workload', 'identity_norm_stats',
           'LanguagePolicy', 'LanguageTask', 'make_engine', 'NARRATION', 'ModelRunner',
           'Observation', 'ObservationError',
           'OutputProcessor', 'random_observation', 'random_setup', 'Scheduler', 'StepCostModel',
           'StepPlan', 'synthetic_frame', 'System', 'TokenDelta', 'Timings', 'UnlimitedBudget',
           'Workload', 'WORKLOADS']
