"""PID's siblings from the same line of work, as attention methods registered beside ``pid`` (their rules as their
official code computes them: docs/methods/siblings.md). Importing this package registers them."""
from . import elliptical, neutreno, twicing, value_residual  # noqa: F401  (each module registers its method)
