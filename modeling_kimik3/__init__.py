# The remote-code files of Kimi K3. They run both from here (`kimik3.modeling`) and copied flat into a model folder,
# so they import each other relatively and nothing else from this package.
