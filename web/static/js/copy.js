// Copy buttons: <button class="copy" data-copy="#selector">.
for (const button of document.querySelectorAll("button.copy")) {
  button.addEventListener("click", async () => {
    const source = document.querySelector(button.dataset.copy);
    if (!source) return;
    const text = source.textContent.trim();
    try {
      await navigator.clipboard.writeText(text);
      button.textContent = "Copied";
    } catch (error) {
      // No clipboard access (an insecure origin, say): select the text for Ctrl-C.
      const range = document.createRange();
      range.selectNodeContents(source);
      const selection = window.getSelection();
      selection.removeAllRanges();
      selection.addRange(range);
      button.textContent = "Selected: press Ctrl-C";
    }
    setTimeout(() => {
      button.textContent = "Copy";
    }, 2000);
  });
}
