"""The recipe test kit under its first name: ``mvp_engine.engine.testkit`` is the kit (tests, tools and third-party
recipes import either)."""

from .testkit import *  # noqa: F403 - the kit's public names, re-exported
from .testkit import __all__  # noqa: F401
