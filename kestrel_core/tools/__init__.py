"""Tools on top of the engine: the sweep, routing traces and their replay, the offline optimum, the batch job, make-model and quantize."""
