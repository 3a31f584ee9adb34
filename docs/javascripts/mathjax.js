// Math on the API pages: pymdownx.arithmatex (generic mode) wraps every formula in an element
// of class "arithmatex" holding \( ... \) or \[ ... \]; MathJax typesets only those elements.
window.MathJax = {
  tex: { inlineMath: [["\\(", "\\)"]], displayMath: [["\\[", "\\]"]] },
  options: { ignoreHtmlClass: "tex2jax_ignore", processHtmlClass: "arithmatex" },
};

// Material's instant navigation swaps page content without a reload: typeset each new page.
if (typeof document$ !== "undefined") {
  document$.subscribe(function () {
    if (window.MathJax && MathJax.typesetPromise) {
      MathJax.typesetPromise();
    }
  });
}
