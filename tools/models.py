"""The bench's models, data, loss and optimizer; Keras loads only inside the builders.

convnet's activations dominate its memory, mlp's weights; bn has BatchNormalization; lm's
Embedding gradient arrives as rows (lm_128k: four times its vocabulary).
"""

import numpy as np

SEED = 0
LEARNING_RATE = 1e-3
# Adam's epsilon where weights are compared with the direct batch's: the default 1e-7 turns
# a near-zero gradient's float32 noise (a window sums in another order) into a step.
ADAM_EPSILON = 1e-5
MODELS = ("convnet", "mlp", "bn", "lm", "lm_128k")
TF1_MODELS = ("convnet", "mlp")  # those with a hand-written TF1 graph (tf1_logits)
INPUT_SHAPES = {"convnet": (32, 32, 3), "mlp": (784,), "bn": (32, 32, 3)}
CLASSES = 10
VOCABULARIES = {"lm": 32_000, "lm_128k": 128_000}
SEQUENCE, WIDTH, FEED_FORWARD, BLOCKS, HEADS = 32, 256, 1024, 2, 4


def loss(reduction="sum_over_batch_size"):
    """The loss every Keras model here trains on (reduction None: one per sample)."""
    import keras
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)


def sample_loss(model):
    """The TF2 accumulators' loss per sample (a sequence's: its tokens' mean, as Keras's)."""
    import tensorflow as tf
    per_sample = loss(None)
    if model not in VOCABULARIES:
        return per_sample
    return lambda y, logits: tf.reduce_mean(per_sample(y, logits), axis=-1)


def adam(**kwargs):
    """Keras's Adam at LEARNING_RATE."""
    import keras
    return keras.optimizers.Adam(LEARNING_RATE, **kwargs)


def post_model(name):
    """A builder of the post's model `name` of model.py, dropout on, seeded."""
    def build():
        import model
        return model.keras_model(name, 0.5, SEED)
    return build


def tokens(vocabulary, samples):
    """Random token sequences and the same shifted by one (the next tokens)."""
    drawn = np.random.default_rng(SEED).integers(
        0, vocabulary, (samples, SEQUENCE + 1)).astype(np.int32)
    return drawn[:, :-1], drawn[:, 1:]


def data(model, samples):
    """Random inputs and labels of the model's shapes, the same for every path."""
    if model in VOCABULARIES:
        return tokens(VOCABULARIES[model], samples)
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((samples,) + INPUT_SHAPES[model]).astype(np.float32)
    return x, rng.integers(0, CLASSES, samples).astype(np.int32)


def keras_model(model, dense_rows=False):
    """The model of MODELS, seeded (dense_rows: language_model's)."""
    import keras
    from keras import layers
    keras.utils.set_random_seed(SEED)
    if model in VOCABULARIES:
        return language_model(VOCABULARIES[model], dense_rows)
    if model == "mlp":
        body = [layers.Dense(4096, activation="relu"), layers.Dense(4096, activation="relu")]
    elif model == "convnet":
        body = [layers.Conv2D(filters, 3, padding="same", activation="relu")
                for filters in (32, 64, 64)] + [layers.GlobalAveragePooling2D()]
    else:
        body = [layers.Conv2D(32, 3, padding="same", use_bias=False),
                layers.BatchNormalization(), layers.ReLU(),
                layers.Conv2D(64, 3, strides=2, padding="same", use_bias=False),
                layers.BatchNormalization(), layers.ReLU(), layers.GlobalAveragePooling2D()]
    return keras.Sequential([keras.Input(INPUT_SHAPES[model]), *body,
                             layers.Dense(CLASSES)])


def language_model(vocabulary, dense_rows=False):
    """A pre-norm causal decoder with an untied Dense(V) output; `dense_rows`: the Embedding's
    gradient made dense inside the model (the same weights, drawn alike)."""
    import keras
    import tensorflow as tf
    from keras import layers

    @tf.custom_gradient
    def dense_gradient(table):
        return tf.identity(table), tf.convert_to_tensor

    class DenseRows(layers.Embedding):
        def call(self, ids):
            return tf.gather(dense_gradient(self.embeddings), ids)

    ids = keras.Input((SEQUENCE,), dtype="int32")
    h = (DenseRows if dense_rows else layers.Embedding)(vocabulary, WIDTH)(ids)
    for _ in range(BLOCKS):
        a = layers.LayerNormalization()(h)
        h = h + layers.MultiHeadAttention(HEADS, WIDTH // HEADS)(a, a, use_causal_mask=True)
        f = layers.LayerNormalization()(h)
        f = layers.Dense(FEED_FORWARD, activation="gelu")(f)
        h = h + layers.Dense(WIDTH)(f)
    return keras.Model(ids, layers.Dense(vocabulary)(layers.LayerNormalization()(h)))


def tf1_logits(model, x):
    """The Keras convnet's or mlp's layers as a v1 graph: v1 variables, matmul and conv2d."""
    import tensorflow as tf
    v1 = tf.compat.v1

    def variable(name, shape, zeros=False):
        return v1.get_variable(name, shape, initializer=v1.zeros_initializer() if zeros
                               else v1.glorot_uniform_initializer(SEED))

    def dense(h, units, name, relu):
        h = tf.matmul(h, variable(name + "/kernel", [h.shape[-1], units]))
        h = h + variable(name + "/bias", [units], zeros=True)
        return tf.nn.relu(h) if relu else h

    h = x
    if model == "mlp":
        h = dense(dense(h, 4096, "dense_1", True), 4096, "dense_2", True)
    else:
        for i, filters in enumerate((32, 64, 64)):
            k = variable(f"conv_{i}/kernel", [3, 3, h.shape[-1], filters])
            h = tf.nn.conv2d(h, k, strides=1, padding="SAME")
            h = tf.nn.relu(h + variable(f"conv_{i}/bias", [filters], zeros=True))
        h = tf.reduce_mean(h, axis=[1, 2])
    return dense(h, CLASSES, "logits", False)
