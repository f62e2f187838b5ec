"""A TF1 graph under a memory limit (tests/library/test_tf1.py runs it in a process of its
own, the CPU as a BFC device): tf1.find_micro_batch finds B for an effective batch of E,
the graph trains two updates cut into N mini-batches (the last shorter) and prints what
it found and saves the weights; the plain direct batch of E runs out of memory there.

    python -m tests.library.tf1_micro_batch_run --out=DIR [--direct]
"""

import argparse
import json
import os

import numpy as np

from tools.models import ADAM_EPSILON

E, UPDATES, HIDDEN, SEED = 4099, 2, 1024, 0  # a prime E: no micro-batch divides it


def data():
    rng = np.random.default_rng(SEED)
    return (rng.normal(size=(E * UPDATES, 784)).astype(np.float32),
            rng.integers(0, 10, E * UPDATES).astype(np.int64))


def graph(averaging):
    """(graph, x, y, weight, train op, optimizer, flush op, trainable variables)."""
    import tensorflow as tf
    from tensorflow.compat import v1

    from gradient_averaging import tf1
    g = tf.Graph()
    with g.as_default():
        v1.set_random_seed(SEED)
        x = v1.placeholder(tf.float32, [None, 784])
        y = v1.placeholder(tf.int64, [None])
        weight = v1.placeholder_with_default(1.0, [])
        hidden = tf.nn.relu(tf.matmul(x, v1.get_variable("w1", [784, HIDDEN])))
        logits = tf.matmul(hidden, v1.get_variable("w2", [HIDDEN, 10]))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=logits))
        # Its epsilon above a near-zero gradient's float32 noise (ADAM_EPSILON): at TF1's
        # 1e-8, 357 weights into one hidden unit were up to 1.3e-4 off the direct batch's.
        adam = v1.train.AdamOptimizer(1e-3, epsilon=ADAM_EPSILON)
        if averaging:
            optimizer = tf1.AveragingOptimizer(adam, average_gradients=2)
            train_op = optimizer.accumulate_gradients(optimizer.compute_gradients(loss),
                                                      weight=weight)
            flush = optimizer.flush_op()
        else:
            optimizer, train_op, flush = adam, adam.minimize(loss), None
        init = v1.global_variables_initializer()
        trainable = v1.trainable_variables()
    return g, x, y, weight, train_op, optimizer, flush, trainable, init


def direct():
    """The plain direct batch of E, UPDATES times: its weights."""
    from tensorflow.compat import v1
    g, x, y, _, train_op, _, _, trainable, init = graph(averaging=False)
    xs, ys = data()
    with v1.Session(graph=g) as sess:
        sess.run(init)
        for u in range(UPDATES):
            sess.run(train_op, {x: xs[u * E:(u + 1) * E], y: ys[u * E:(u + 1) * E]})
        return sess.run(trainable)


def accumulated(out):
    from tensorflow.compat import v1

    from gradient_averaging import tf1
    g, x, y, weight, train_op, optimizer, flush, trainable, init = graph(averaging=True)
    xs, ys = data()
    with v1.Session(graph=g) as sess:
        sess.run(init)
        before = sess.run(trainable)
        found = tf1.find_micro_batch(sess, optimizer, train_op, {x: xs[:E], y: ys[:E]}, E)
        unchanged = all(np.array_equal(a, b) for a, b in zip(before, sess.run(trainable)))
        b = found.micro_batch_size
        for u in range(UPDATES):
            for start in range(u * E, (u + 1) * E, b):
                end = min(start + b, (u + 1) * E)
                sess.run(train_op, {x: xs[start:end], y: ys[start:end], weight: end - start})
            sess.run(flush)
        np.savez(os.path.join(out, "tf1.npz"), *sess.run(trainable))
    return {"found": found._asdict(), "unchanged": unchanged}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--direct", action="store_true", help="the direct batch only")
    args = parser.parse_args()
    if args.direct:
        np.savez(os.path.join(args.out, "direct.npz"), *direct())
        return
    result = accumulated(args.out)
    import tensorflow as tf
    try:  # the direct batch, under the same limit
        direct()
        result["direct"] = "fits"
    except tf.errors.ResourceExhaustedError:
        result["direct"] = "out of memory"
    print(json.dumps(result))


if __name__ == "__main__":
    from experiment import cli
    cli.import_tensorflow_quietly()
    main()
