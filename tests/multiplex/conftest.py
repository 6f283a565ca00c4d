"""The multiplexer's tests run the layouts of tests/parallel (its ``layout_harness`` and
``dist_helpers``), also when this folder runs on its own."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parallel"))
