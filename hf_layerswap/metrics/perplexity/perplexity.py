"""Corpus perplexity under a stated contract, as an `evaluate` module (works offline).

Load it from the installed package (no Hub access needed):

    import evaluate
    from hf_layerswap.evaluation import perplexity_metric_path
    metric = evaluate.load(perplexity_metric_path())
    metric.compute(model=model, tokenizer=tokenizer, text="path/or/text")   # or predictions=[...]

Unlike the Hub's `perplexity` metric (mean of per-text perplexities, model given by id),
this returns one token-weighted corpus perplexity computed with sliding windows by
`hf_layerswap.evaluation.evaluate_perplexity`, with its bootstrap interval and the full
contract. `model` may be a loaded model or anything `hf_layerswap.models.load_model`
accepts (a bundled name such as "smollm2-135m", a local directory, a .gguf file).
"""

import datasets
import evaluate

from hf_layerswap.evaluation import evaluate_perplexity
from hf_layerswap.models import load_model

_DESCRIPTION = (
    "Token-weighted corpus perplexity with sliding windows (matched contract by default: "
    "first 5,000 words, window 512, stride 256, only new tokens scored), bootstrap CI over windows."
)

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of str, optional): texts, joined with blank lines into one corpus.
    text (str or path, optional): the corpus instead of predictions; neither = the embedded
        evaluation text.
    model: a causal LM, or a name/path for hf_layerswap.models.load_model.
    tokenizer: optional; loaded with the model by default.
    Every other keyword goes to hf_layerswap.evaluation.evaluate_perplexity (contract,
    window, stride, max_words, bootstrap, seed, batch_size, add_bos).
Returns:
    perplexity, nll (nats), tokens, windows, ci_low, ci_high, contract (dict).
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Perplexity(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            module_type="metric",
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("string")}),
        )

    def compute(self, *, predictions=None, references=None, **kwargs):
        """Corpus perplexity of `predictions` (list of str) or `text=`; see the module doc.
        """
        # evaluate's compute() insists on stored predictions; a corpus given as text= has none
        if predictions is None and references is None:
            return self._compute(**kwargs)
        return super().compute(predictions=predictions, references=references, **kwargs)

    def _compute(self, predictions=None, model=None, tokenizer=None, text=None, **kwargs):
        if model is None:
            raise ValueError("perplexity needs model=... (a loaded causal LM or a name/path to load)")
        if predictions is not None and text is not None:
            raise ValueError("give either predictions or text, not both")
        if isinstance(model, str):
            model, loaded_tokenizer = load_model(model)
            tokenizer = tokenizer or loaded_tokenizer
        if predictions is not None:
            text = [str(p) for p in predictions]
        result = evaluate_perplexity(model, text, tokenizer=tokenizer, **kwargs)
        return {
            "perplexity": result.ppl,
            "nll": result.nll,
            "tokens": result.tokens,
            "windows": result.windows,
            "ci_low": result.ci_low,
            "ci_high": result.ci_high,
            "contract": result.contract,
        }
