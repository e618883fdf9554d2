"""Healing: distil a pruned model from its dense base with transformers' ``Trainer``
(:func:`heal`), by a method from one registry (:data:`HEAL_METHODS`)."""

from .distill import heal
from .loss import distillation_loss
from .methods import HEAL_METHODS, HealMethod, get_heal_method, register_heal_method
from .report import HealReport
from .teacher import check_teacher
from ..utils.registry import import_package_modules

__all__ = [
    "HEAL_METHODS",
    "HealMethod",
    "HealReport",
    "check_teacher",
    "distillation_loss",
    "get_heal_method",
    "heal",
    "register_heal_method",
]

import_package_modules(__name__, __path__)  # a healing method in a module of its own registers too
