"""Quality benchmarks: the labels of what each KV form keeps, the estimators that predict
them, and answer quality end to end."""
