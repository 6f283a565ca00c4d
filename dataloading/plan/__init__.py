"""Planning on metadata alone: mixtures and curricula, the cost model, balancing, the planner with
central state, exact token counts, how split pieces are named. Of the other sub-packages it
imports ``formats`` and ``index``."""
