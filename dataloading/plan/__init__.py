"""Planning on metadata alone: mixtures and curricula, the cost model, balancing, the planner with central state, exact token counts, how split pieces are named. Imports ``formats`` and ``index``."""
