"""Multiple-choice accuracy (RACE), optionally per group (`evaluate` module).

Inputs, one row per question:
    predictions  int  argmax over the 4 option logits
    references   int  gold option (0..3)
    groups       str  e.g. "middle" / "high"
Output: {"accuracy", "correct", "count"} overall and "<group>/accuracy|correct|count" per group
(Megatron's tasks/eval_utils.py: correct / total per validation path and overall).
"""
import datasets
import evaluate


class RaceAccuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__,
            citation="@inproceedings{lai2017race, title={RACE: Large-scale ReAding Comprehension Dataset From "
                     "Examinations}, author={Lai, Guokun and others}, booktitle={EMNLP}, year={2017}}",
            inputs_description=__doc__,
            features=datasets.Features({
                "predictions": datasets.Value("int64"),
                "references": datasets.Value("int64"),
                "groups": datasets.Value("string"),
            }),
        )

    def _compute(self, predictions, references, groups):
        out = {}
        buckets = {}
        for p, r, g in zip(predictions, references, groups):
            c, n = buckets.get(g, (0, 0))
            buckets[g] = (c + int(p == r), n + 1)
        for g in sorted(buckets):
            c, n = buckets[g]
            out[f"{g}/accuracy"] = c / n
            out[f"{g}/correct"] = c
            out[f"{g}/count"] = n
        total = sum(n for _, n in buckets.values())
        correct = sum(c for c, _ in buckets.values())
        out["accuracy"] = correct / total if total else float("nan")
        out["correct"] = correct
        out["count"] = total
        return out
