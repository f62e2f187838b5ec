"""The post's networks, described once and built two ways: a TF1 graph and a Keras model.

`LAYERS` lists each network's layers in order; `build` makes the TF1 graph from them
(tf.nn ops, tf.compat.v1.get_variable, no Keras), `keras_model` the Keras model (for the
tf2 engine). Both give the same network, with the same initializer family (Glorot-uniform
kernels, zero biases) and each layer seeded on its own, so that the initial weights
depend on the seed only, not on anything else built beside them.

The TF1 builder creates its variables with `get_variable` under a reusing variable
scope, so calling it again (on another slice of the data, inside a loop) shares the same
weights. Its dropout is stateless: the masks are a function of a fed seed (the engine
feeds [run seed, iteration]), not of hidden kernel state, so runs repeat bit for bit and
a resumed run draws the masks of one never interrupted. The Keras model's dropout layers
draw from seed generators, whose state is saved with its weights.
"""

import collections

import tensorflow as tf

v1 = tf.compat.v1

INPUT_DROPOUT_CAP = 0.2  # the input's dropout rate: min(this, the hidden rate)
IMAGE_SHAPE, CLASSES = (28, 28, 1), 10

Layer = collections.namedtuple("Layer", ["kind", "size", "activation"], defaults=(None, None))

# Each network, input to logits. Dropout layers say which rate they take: "input" or
# "hidden"; the last dense layer gives the logits (linear: the original's ReLU on its
# logits is not reproduced, docs/model-and-data.md says why).
LAYERS = {
    # The post's LeNet-5-like ConvNet, 44,426 parameters.
    "convnet": (Layer("dropout", "input"),
                Layer("conv", 6, "relu"), Layer("pool", 2), Layer("dropout", "hidden"),
                Layer("conv", 16, "relu"), Layer("pool", 2), Layer("dropout", "hidden"),
                Layer("flatten"),
                Layer("dense", 120, "relu"), Layer("dropout", "hidden"),
                Layer("dense", 84, "relu"), Layer("dropout", "hidden"),
                Layer("dense", CLASSES)),
    # A large dense network, about 20M parameters, so that gradient memory dominates (the
    # memory benchmark).
    "mlp": (Layer("flatten"), Layer("dropout", "input"),
            Layer("dense", 4096, "relu"), Layer("dropout", "hidden"),
            Layer("dense", 4096, "relu"), Layer("dropout", "hidden"),
            Layer("dense", CLASSES)),
}
KERNEL_SIZE = 5  # every conv layer's, VALID padding

ModelOps = collections.namedtuple("ModelOps", ["logits", "loss", "num_correct", "accuracy"])


def _rate(layer, dropout):
    return min(INPUT_DROPOUT_CAP, dropout) if layer.size == "input" else dropout


# ---------------------------------------------------------------- the TF1 graph


def logits(model_name, images, training, dropout_seed, dropout=0.5):
    """The named network on an NHWC image batch, as a TF1 graph.

    Kernels are Glorot-uniform with op seed k for the k-th layer with weights (so the
    graph seed alone fixes them); conv layers are named conv<k>, dense ones fc<k>, the
    last `logits`, under a variable scope named after the network.

    Args:
      images: float32 [batch, 28, 28, 1].
      training: bool scalar tensor; dropout is active only when it is True.
      dropout_seed: int64 [2] tensor, this mini-batch's dropout seed.
      dropout: the hidden dropout rate; the input gets min(0.2, dropout).

    Returns:
      logits, float32 [batch, 10].
    """
    layers = LAYERS[model_name]
    last_dense = max(i for i, layer in enumerate(layers) if layer.kind == "dense")
    weighted = {"conv": 0, "dense": 0}
    x, dropouts = images, 0
    with v1.variable_scope(model_name, reuse=v1.AUTO_REUSE):
        for i, layer in enumerate(layers):
            if layer.kind == "dropout":
                x = _dropout(x, _rate(layer, dropout), training, dropout_seed, dropouts)
                dropouts += 1
            elif layer.kind == "pool":
                x = tf.nn.max_pool2d(x, ksize=layer.size, strides=layer.size, padding="VALID")
            elif layer.kind == "flatten":
                x = tf.reshape(x, [-1, x.shape[1:].num_elements()])
            else:
                weighted[layer.kind] += 1
                seed = sum(weighted.values())
                if layer.kind == "conv":
                    w, b = _weights_and_biases(
                        f"conv{weighted['conv']}",
                        [KERNEL_SIZE, KERNEL_SIZE, x.shape[-1], layer.size], seed)
                    x = tf.nn.conv2d(x, w, strides=1, padding="VALID") + b
                else:
                    name = "logits" if i == last_dense else f"fc{weighted['dense']}"
                    w, b = _weights_and_biases(name, [x.shape[-1], layer.size], seed)
                    x = tf.matmul(x, w) + b
                if layer.activation:
                    x = getattr(tf.nn, layer.activation)(x)
    return x


def _weights_and_biases(name, shape, seed):
    """A layer's kernel (`shape`), Glorot-uniform with op seed `seed`, and its zero biases."""
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


def build(model_name, images, labels, training, dropout_seed, dropout):
    """Builds the named network on `images` and its loss and accuracy ops (TF1 graph).

    Args:
      labels: int64 [batch] class ids (one-hot encoded here for the loss).
      training, dropout_seed, dropout: as for `logits`.

    Returns:
      ModelOps: `loss` is the softmax cross-entropy averaged over the batch,
      `num_correct` an int32 count, `accuracy` the fraction correct.
    """
    out = logits(model_name, images, training, dropout_seed, dropout)
    loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(
        labels=tf.one_hot(labels, CLASSES), logits=out))
    correct = tf.equal(tf.argmax(out, axis=1), labels)
    return ModelOps(logits=out, loss=loss,
                    num_correct=tf.reduce_sum(tf.cast(correct, tf.int32)),
                    accuracy=tf.reduce_mean(tf.cast(correct, tf.float32)))


def activation_sizes(model_name):
    """Elements per image of the input and of each layer's output, input to logits.

    What a forward pass holds, to size evaluation chunks without running the network
    (dropout and flatten keep the size, and are listed as layers too).
    """
    height, width, channels = IMAGE_SHAPE
    sizes = [height * width * channels]
    for layer in LAYERS[model_name]:
        if layer.kind == "conv":  # VALID padding
            height, width = height - KERNEL_SIZE + 1, width - KERNEL_SIZE + 1
            channels = layer.size
        elif layer.kind == "pool":
            height, width = height // layer.size, width // layer.size
        elif layer.kind == "flatten":
            height, width, channels = 1, 1, height * width * channels
        elif layer.kind == "dense":
            height, width, channels = 1, 1, layer.size
        sizes.append(height * width * channels)
    return sizes


def count_parameters(var_list=None):
    """Number of trainable scalars in the default graph (or in `var_list`)."""
    variables = v1.trainable_variables() if var_list is None else var_list
    return sum(v.shape.num_elements() for v in variables)


# ---------------------------------------------------------------- the Keras model


def keras_model(model_name, dropout=0.5, seed=0):
    """The named network as a Keras Sequential model (the tf2 engine's).

    The k-th layer with weights takes GlorotUniform(100 * seed + k), the j-th dropout
    layer with a non-zero rate Dropout(seed=100 * seed + 50 + j): kernels and dropout
    layers count apart, so turning dropout off changes no kernel.
    """
    import keras  # only here: the TF1 graph needs no Keras

    kernel_seed, dropout_seed = seed * 100, seed * 100 + 50
    stack = [keras.Input(IMAGE_SHAPE)]
    for layer in LAYERS[model_name]:
        if layer.kind == "dropout":
            rate = _rate(layer, dropout)
            if rate <= 0:
                stack.append(keras.layers.Identity())
                continue
            dropout_seed += 1
            stack.append(keras.layers.Dropout(rate, seed=dropout_seed))
        elif layer.kind == "pool":
            stack.append(keras.layers.MaxPool2D(layer.size))
        elif layer.kind == "flatten":
            stack.append(keras.layers.Flatten())
        else:
            kernel_seed += 1
            initializer = keras.initializers.GlorotUniform(kernel_seed)
            if layer.kind == "conv":
                stack.append(keras.layers.Conv2D(layer.size, KERNEL_SIZE, padding="valid",
                                                 activation=layer.activation,
                                                 kernel_initializer=initializer))
            else:
                stack.append(keras.layers.Dense(layer.size, activation=layer.activation,
                                                kernel_initializer=initializer))
    return keras.Sequential(stack, name=model_name)
