"""Asynchronous RL's first pieces (issue 47): the world split into trainer and generator ranks (`placement.py`),
the actor's tensors named and resharded from the trainers' TP x PP layout to a generator's TP (`weights.py`), and
their streaming in buckets over a dedicated process group with a weight version (`streaming.py`). The schedule
that overlaps generation with training is not here yet (docs/parallelism.md, "Asynchronous placement")."""
