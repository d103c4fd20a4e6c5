"""actmem: activation memory of large transformer training runs.

The equations are those of Korthikanti et al. (2022), "Reducing Activation
Recomputation in Large Transformer Models" (Eqs 1-6, Table 2, sections 4.4-4.5).
This package is pure Python and never imports torch; the measured-validation
harness lives outside it.
"""

__version__ = "0.1.0"
