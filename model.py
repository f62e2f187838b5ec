"""The networks, built from tf.nn ops and tf.compat.v1.get_variable (no Keras layers).

Each model function maps an NHWC image batch to logits. It creates its variables with
`get_variable` under a reusing variable scope, so calling it again (on another slice of
the data, inside a loop) shares the same weights. Initializers carry fixed op-level
seeds so that, for a given graph seed, the initial weights do not depend on anything
else built in the graph (the accumulation strategy, the batch size).

Dropout is stateless: its masks are a function of a fed seed (the trainer feeds
[run seed, iteration]), not of hidden kernel state. So runs are repeatable bit for bit
and a run resumed from a checkpoint draws the same masks as one never interrupted.
"""

import collections

import tensorflow as tf

v1 = tf.compat.v1

INPUT_DROPOUT_CAP = 0.2

ModelOps = collections.namedtuple("ModelOps", ["logits", "loss", "num_correct", "accuracy"])


def _weights_and_biases(name, shape, seed):
    """A layer's kernel (a conv's or a dense layer's, `shape`), Glorot-uniform with op seed
    `seed`, and its zero biases."""
    with v1.variable_scope(name):
        w = v1.get_variable("weights", shape, initializer=v1.glorot_uniform_initializer(seed=seed))
        b = v1.get_variable("biases", shape[-1:], initializer=v1.zeros_initializer())
    return w, b


def _dropout(x, rate, training, seed, layer):
    """Dropout only when `training` is fed True; nothing at all when rate is 0."""
    if rate <= 0:
        return x
    layer_seed = tf.random.experimental.stateless_fold_in(seed, layer)
    return tf.cond(training,
                   lambda: tf.nn.experimental.stateless_dropout(x, rate, seed=layer_seed),
                   lambda: x)


def conv_net(images, training, dropout_seed, dropout=0.5):
    """The post's LeNet-5-like ConvNet (44,426 parameters) with linear logits.

    The original put a ReLU on the 10 output logits; that quirk is not reproduced
    (docs/model-and-data.md explains why).

    Args:
      images: float32 [batch, 28, 28, 1].
      training: bool scalar tensor; dropout is active only when it is True.
      dropout_seed: int64 [2] tensor, this mini-batch's dropout seed.
      dropout: the hidden dropout rate; the input gets min(0.2, dropout).

    Returns:
      logits, float32 [batch, 10].
    """
    with v1.variable_scope("convnet", reuse=v1.AUTO_REUSE):
        x = _dropout(images, min(INPUT_DROPOUT_CAP, dropout), training, dropout_seed, 0)
        for i, (ksize, c_in, c_out) in enumerate([(5, 1, 6), (5, 6, 16)]):
            w, b = _weights_and_biases(f"conv{i + 1}", [ksize, ksize, c_in, c_out], seed=i + 1)
            x = tf.nn.relu(tf.nn.conv2d(x, w, strides=1, padding="VALID") + b)
            x = tf.nn.max_pool2d(x, ksize=2, strides=2, padding="VALID")
            x = _dropout(x, dropout, training, dropout_seed, i + 1)
        x = tf.reshape(x, [-1, 4 * 4 * 16])
        for i, (n_in, n_out) in enumerate([(256, 120), (120, 84)]):
            w, b = _weights_and_biases(f"fc{i + 1}", [n_in, n_out], seed=i + 3)
            x = _dropout(tf.nn.relu(tf.matmul(x, w) + b), dropout, training, dropout_seed, i + 3)
        w, b = _weights_and_biases("logits", [84, 10], seed=5)
        return tf.matmul(x, w) + b


def mlp(images, training, dropout_seed, dropout=0.5, hidden=(4096, 4096)):
    """A large dense network (784-4096-4096-10, about 20M parameters).

    It exists to make gradient memory dominate, so that the host memory each
    accumulation strategy keeps per window can be measured.
    """
    with v1.variable_scope("mlp", reuse=v1.AUTO_REUSE):
        x = _dropout(tf.reshape(images, [-1, 784]), min(INPUT_DROPOUT_CAP, dropout), training,
                     dropout_seed, 0)
        sizes = (784,) + tuple(hidden)
        for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            w, b = _weights_and_biases(f"fc{i + 1}", [n_in, n_out], seed=i + 1)
            x = _dropout(tf.nn.relu(tf.matmul(x, w) + b), dropout, training, dropout_seed, i + 1)
        w, b = _weights_and_biases("logits", [sizes[-1], 10], seed=len(hidden) + 1)
        return tf.matmul(x, w) + b


MODELS = {"convnet": conv_net, "mlp": mlp}


def build(model_name, images, labels, training, dropout_seed, dropout):
    """Builds the named model on `images` and its loss and accuracy ops.

    Args:
      labels: int64 [batch] class ids (one-hot encoded here for the loss).
      training, dropout_seed, dropout: as for conv_net.

    Returns:
      ModelOps: `loss` is the softmax cross-entropy averaged over the batch,
      `num_correct` an int32 count, `accuracy` the fraction correct.
    """
    logits = MODELS[model_name](images, training, dropout_seed, dropout)
    loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(
        labels=tf.one_hot(labels, 10), logits=logits))
    correct = tf.equal(tf.argmax(logits, axis=1), labels)
    return ModelOps(logits=logits, loss=loss,
                    num_correct=tf.reduce_sum(tf.cast(correct, tf.int32)),
                    accuracy=tf.reduce_mean(tf.cast(correct, tf.float32)))


def count_parameters(var_list=None):
    """Number of trainable scalars in the default graph (or in `var_list`)."""
    variables = v1.trainable_variables() if var_list is None else var_list
    return sum(v.shape.num_elements() for v in variables)
