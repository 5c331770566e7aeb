// Progressive enhancement for the console; every page works without it.
document.addEventListener("DOMContentLoaded", () => {
  // Tenant switcher: submit on change.
  document.querySelectorAll("select[data-autosubmit]").forEach((select) => {
    select.addEventListener("change", () => select.form.submit());
  });
  // Copy buttons: <button data-copy="#element-id">.
  document.querySelectorAll("button[data-copy]").forEach((button) => {
    button.hidden = false;
    button.addEventListener("click", async () => {
      const source = document.querySelector(button.dataset.copy);
      const text = source.value !== undefined ? source.value : source.textContent;
      try {
        await navigator.clipboard.writeText(text.trim());
      } catch (err) {
        // Clipboard API refused (plain http on another host): select the text instead.
        if (source.select) { source.select(); }
        document.execCommand && document.execCommand("copy");
      }
      button.textContent = "Copied";
      setTimeout(() => { button.textContent = "Copy"; }, 2000);
    });
  });
  // Confirmation for destructive forms: <form data-confirm="Revoke this key?">.
  document.querySelectorAll("form[data-confirm]").forEach((form) => {
    form.addEventListener("submit", (event) => {
      if (!window.confirm(form.dataset.confirm)) { event.preventDefault(); }
    });
  });
});
