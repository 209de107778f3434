"""Evaluation harness: the numbers users compare encoders by, from any bundle and snapshot.

paraphrase: AO@k / JS@k between the top-k lists of a query and its paraphrase (Cheng et al.);
retrieval: text-to-image and image-to-text R@1/5/10 and RSUM; sts: Spearman/Pearson of cosine
similarity vs gold scores; perturb: robustness to character- and word-level perturbations (COCO-TP
style); compare: the suite over several bundles as one table with plots. No torch.
"""
