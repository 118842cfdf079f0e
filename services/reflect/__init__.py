"""reflect: answers a question by reasoning over a bank. Without a language model the
answer is extractive: assembled from recalled memories and marked as such."""
