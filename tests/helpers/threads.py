"""A batch's shards run side by side in threads of one process, with an in-process all-reduce (`sum_across`): how
the loss tests check that the shares of any split add up to the whole batch's numbers without spawning."""


def shards_in_threads(fn, shards):
    """Run fn(shard, sum_across) on every shard concurrently, with `sum_across` an in-process all-reduce."""
    import threading

    barrier = threading.Barrier(len(shards))
    slots = [None] * len(shards)
    results = [None] * len(shards)

    def run(i):
        def sum_across(t):
            slots[i] = t
            barrier.wait()
            total = sum(slots[1:], slots[0])
            barrier.wait()  # everyone has read the slots before they are reused
            return total

        results[i] = fn(shards[i], sum_across)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(shards))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results
