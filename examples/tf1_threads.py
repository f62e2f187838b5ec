"""Several threads running one train op on one session, as the TF1 word2vec tutorial's
`concurrent_steps` does: each run adds its mini-batch and, every Nth, applies the window
under a lock, so every update is the mean of exactly N mini-batches.

    .venv/bin/python -m examples.tf1_threads         (docs/tf1-code.md, "Threads")
"""

import threading

import numpy as np
import tensorflow as tf

from gradient_averaging import AveragingOptimizer

v1 = tf.compat.v1
N, THREADS, RUNS = 4, 4, 100

with tf.Graph().as_default():
    target = v1.placeholder(tf.float64, [None])
    samples = v1.placeholder(tf.float64, [])           # this mini-batch's weight
    w = tf.Variable(0.0, dtype=tf.float64)
    loss = tf.reduce_mean(tf.square(w - target)) / 2   # its gradient: w - mean(target)
    global_step = v1.train.get_or_create_global_step()
    optimizer = AveragingOptimizer(v1.train.GradientDescentOptimizer(0.1), average_gradients=N)
    train_op = optimizer.minimize(loss, global_step=global_step, weight=samples)
    with v1.Session() as sess:
        sess.run(v1.global_variables_initializer())

        def trainer(seed):
            rng = np.random.RandomState(seed)
            for _ in range(RUNS):
                batch = rng.normal(3.0, 1.0, size=rng.randint(1, 9))
                sess.run(train_op, {target: batch, samples: len(batch)})

        threads = [threading.Thread(target=trainer, args=(k,)) for k in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        updates, open_count, weight = sess.run([global_step, optimizer.window_count, w])

assert updates * N + open_count == THREADS * RUNS, (updates, open_count)
assert np.isfinite(weight) and abs(weight - 3.0) < 0.5, weight
print(f"{THREADS} threads x {RUNS} runs: {updates} updates of {N} mini-batches each, "
      f"{open_count} open; w = {weight:.3f} (the targets' mean is 3)")
