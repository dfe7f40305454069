"""A sequence's text: the tokenizer and prompt validation (`tokenizer`, `validation`), incremental
detokenizing (`detokenizer`), stop strings (`stop`), thinking budgets (`thinking`) and grammars
(`grammar_compiler`, `token_mask`)."""
