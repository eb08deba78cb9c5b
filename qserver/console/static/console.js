// The console's one script: the pages work without it; it only keeps parts of a page live.
// An element with data-refresh="SECONDS" is replaced, every SECONDS, by the element of the same
// id in a fresh copy of the page (the same server-side rendering, so no second template).
"use strict";
(function () {
  function refresh(element) {
    var seconds = parseFloat(element.getAttribute("data-refresh")) || 5;
    setTimeout(function tick() {
      if (document.hidden) { setTimeout(tick, seconds * 1000); return; }
      fetch(window.location.href, { credentials: "same-origin", headers: { "X-Console-Refresh": "1" } })
        .then(function (answer) { return answer.ok ? answer.text() : null; })
        .then(function (text) {
          if (text !== null) {
            var fresh = new DOMParser().parseFromString(text, "text/html").getElementById(element.id);
            if (fresh) { element.replaceWith(fresh); element = fresh; }
          }
        })
        .catch(function () { /* the node is away: try again at the next tick */ })
        .then(function () { setTimeout(tick, seconds * 1000); });
    }, seconds * 1000);
  }
  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("[data-refresh][id]").forEach(refresh);
  });
})();
