from lowering.rules import coverage_markdown

print(coverage_markdown(), end="")
